"""``neuronmp/__init__.py``: the public API ``__all__`` names, loaded lazily.

Each check runs in a fresh interpreter: whether torch is imported, and what a star
import binds, depend on what the process imported before.
"""
from __future__ import annotations

import json
import subprocess
import sys

import neuronmp
from neuronmp import errors

#: the Neuron SDK's names neuronmp stands in for (torch_neuronx / torch.neuron)
SDK_NAMES = {"trace", "DataParallel", "set_neuron_cores", "set_multicore", "dynamic_batch",
             "lazy_load", "async_load", "move_trace_to_device", "replace_weights", "analyze",
             "neuron_cores_context", "multicore_context"}


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_star_import_yields_exactly_the_public_api():
    got = _run("import json\nbefore = set(dir()) | {'before'}\nfrom neuronmp import *\n"
               "print(json.dumps(sorted(set(dir()) - before)))")
    assert got == sorted(neuronmp.__all__)
    assert SDK_NAMES <= set(got)
    assert not {"runtime", "reservation", "liveness", "sys", "importlib", "Tuple",
                "annotations"} & set(got)


def test_every_public_name_resolves_and_every_reexported_error_is_listed():
    for name in neuronmp.__all__:
        assert getattr(neuronmp, name) is not None, name
    reexported = {n for n in vars(neuronmp) if isinstance(getattr(errors, n, None), type)}
    assert reexported <= set(neuronmp.__all__)
    assert len(neuronmp.__all__) == len(set(neuronmp.__all__))


def test_import_neuronmp_stays_cheap():
    got = _run("import json, sys, neuronmp\n"
               "print(json.dumps(['torch' in sys.modules, neuronmp.core_count() > 0,"
               " 'torch' in sys.modules]))")
    assert got == [False, True, False]
