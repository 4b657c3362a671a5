"""The paths users write: they stay where they are however the package's layers move.

Internal modules move between subpackages (tests/test_layers.py keeps them in
order); these names are the public face and must keep resolving: the SDK API on
the package root, the public modules, the commands and the entry points the
distribution declares, and the Neuron SDK stand-ins.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import warnings

import pytest

import neuronmp

#: names on the package root a user writes as ``neuronmp.<name>``
ROOT_NAMES = ["trace", "DataParallel", "dynamic_batch", "lazy_load", "async_load",
              "move_trace_to_device", "replace_weights", "analyze", "set_neuron_cores",
              "set_multicore", "neuron_cores_context", "multicore_context",
              "device_time_context", "DeviceTime", "init", "shutdown", "record",
              "visible_cores", "core_count", "NeuronmpError", "CoreUnavailableError"]

#: module -> names a user imports from it
MODULES = {
    "neuronmp.experimental": [],
    "neuronmp.errors": ["NeuronmpError", "CoreUnavailableError", "PoolClosedError"],
    "neuronmp.batching": ["BatchingServer", "QueuePolicy"],
    "neuronmp.server": [],
    "neuronmp.torchneuron": [],
    "neuronmp.launch": [],
    "neuronmp.pytest_plugin": [],
    # the one internal path the guides name (docs/guides/partitioning.md)
    "neuronmp.host.visibility": ["local_to_global"],
}

#: group -> {entry point name: "module:attribute"} as setup.cfg declares them
ENTRY_POINTS = {
    "console_scripts": {"neuronmp-ls": "neuronmp.cli.ls:main",
                        "neuronmp-run": "neuronmp.cli.run:main",
                        "neuronmp-top": "neuronmp.cli.top:main",
                        "neuronmp-monitor": "neuronmp.cli.monitor:main",
                        "neuronmp-serve": "neuronmp.server.__main__:main"},
    "pytest11": {"neuronmp.pytest_plugin": "neuronmp.pytest_plugin"},
    "torch.backends": {"neuronmp_torchneuron": "_neuronmp_provide:autoload_torch"},
    "torch_dynamo_backends": {"neuron": "neuronmp.torchneuron.backend:neuron_backend"},
}


@pytest.mark.parametrize("name", ROOT_NAMES)
def test_the_package_root_names_the_sdk_api(name):
    assert getattr(neuronmp, name) is not None
    assert name in neuronmp.__all__


@pytest.mark.parametrize("module", sorted(MODULES))
def test_public_modules_import_with_their_names(module):
    mod = importlib.import_module(module)
    missing = [n for n in MODULES[module] if getattr(mod, n, None) is None]
    assert not missing, f"{module} lost {missing}"


def test_the_root_names_its_submodules_and_the_deprecated_alias_still_warns():
    assert neuronmp.experimental is importlib.import_module("neuronmp.experimental")
    assert neuronmp.batching.BatchingServer is \
        importlib.import_module("neuronmp.batching").BatchingServer
    serve = importlib.import_module("neuronmp.serve")
    vars(serve).pop("BatchingServer", None)   # the alias keeps a name once it warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server = serve.BatchingServer
    assert server is neuronmp.batching.BatchingServer
    assert [w.category for w in caught] == [DeprecationWarning]


@pytest.mark.parametrize("group", sorted(ENTRY_POINTS))
def test_the_declared_entry_points_resolve(group):
    declared = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)
                if ep.value.split(":")[0].split(".")[0] in ("neuronmp", "_neuronmp_provide")}
    assert {n: ep.value for n, ep in declared.items()} == ENTRY_POINTS[group]
    for ep in declared.values():
        assert ep.load() is not None, ep.value


@pytest.mark.parametrize("command", [["neuronmp-ls", "--help"], ["neuronmp-run", "--help"],
                                     ["neuronmp-monitor", "--help"],
                                     ["neuronmp-serve", "--help"],
                                     [sys.executable, "-m", "neuronmp.server", "--help"],
                                     [sys.executable, "-m", "neuronmp.serve", "--help"]])
def test_the_commands_start(command):
    if not command[0].startswith(sys.executable):
        command = [os.path.join(os.path.dirname(sys.executable), command[0])] + command[1:]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()


def test_python_m_neuronmp_is_the_demo():
    spec = importlib.util.find_spec("neuronmp.__main__")
    assert spec is not None and spec.origin.endswith(os.path.join("neuronmp", "__main__.py"))
    assert callable(importlib.import_module("neuronmp.__main__").main)


def test_the_sdk_stand_ins_import_under_the_sdks_names():
    code = ("import json, torch_neuronx, torch_neuron, neuronmp\n"
            "print(json.dumps({'trace': torch_neuronx.trace is neuronmp.trace,\n"
            "                  'dp': torch_neuronx.DataParallel is neuronmp.DataParallel,\n"
            "                  'file': torch_neuron.__file__}))")
    env = dict(os.environ, NEURONMP_PROVIDE="torch_neuronx,torch_neuron")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["trace"] and out["dp"]
    assert os.path.join("neuronmp", "provide", "torch_neuron") in out["file"]
