"""The settings object: parsed once per runtime, from the environment without one.

The table of every variable (a good value, a bad value) is in test_docs.py, against
docs/reference.md; here is when the environment is read.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neuronmp.errors import ConfigError
from neuronmp.host import runtime, settings


def test_a_runtime_keeps_the_settings_it_started_with(monkeypatch):
    monkeypatch.setenv("NEURONMP_RING_BYTES", "1MiB")
    rt = runtime.init()
    monkeypatch.setenv("NEURONMP_RING_BYTES", "2MiB")
    monkeypatch.setenv("NEURONMP_SHM_MAX_REGIONS", "not a number")
    assert settings.get("ring_bytes") == 1 << 20 == rt.settings.ring_bytes
    assert settings.get("shm_max_regions") == 256   # read at init, before the change
    assert settings.current() is rt.settings
    runtime.shutdown()
    assert settings.get("ring_bytes") == 2 << 20    # between runtimes: the new value
    with pytest.raises(ConfigError, match="NEURONMP_SHM_MAX_REGIONS"):
        runtime.init()
    assert not runtime.is_initialized()
    monkeypatch.delenv("NEURONMP_SHM_MAX_REGIONS")
    assert runtime.init().settings.ring_bytes == 2 << 20


def test_a_runtime_closing_late_leaves_the_next_ones_settings_pinned(monkeypatch):
    first = runtime.init()
    runtime.shutdown()
    monkeypatch.setenv("NEURONMP_RING_BYTES", "1MiB")
    second = runtime.init()
    settings.unpin(first.settings)   # what a late close of the first runtime does
    assert settings.current() is second.settings
    monkeypatch.setenv("NEURONMP_RING_BYTES", "2MiB")
    assert settings.get("ring_bytes") == 1 << 20


def test_without_a_runtime_a_bad_value_fails_only_its_readers(monkeypatch):
    monkeypatch.setenv("NEURONMP_IPC_SPIN_US", "fast")
    assert settings.get("reserve_timeout") == 0.0
    with pytest.raises(ConfigError) as info:
        settings.get("ipc_spin")
    assert info.value.variable == "NEURONMP_IPC_SPIN_US" and info.value.value == "fast"
    monkeypatch.setenv("NEURONMP_IPC_SPIN_US", "70")
    assert settings.get("ipc_spin") == pytest.approx(70e-6)


def test_a_relative_runtime_dir_follows_the_working_directory(monkeypatch, tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    monkeypatch.setenv("NEURONMP_RUNTIME_DIR", "rt")
    monkeypatch.chdir(tmp_path / "a")
    assert settings.get("runtime_dir") == str(tmp_path / "a" / "rt")
    monkeypatch.chdir(tmp_path / "b")
    assert settings.get("runtime_dir") == str(tmp_path / "b" / "rt")


def test_the_ipc_pause_never_exceeds_the_spin():
    env = {"NEURONMP_IPC_SPIN_US": "10", "NEURONMP_IPC_PAUSE_US": "40"}
    assert settings.parse_field("ipc_pause", env) == pytest.approx(10e-6)


def test_a_forked_child_reads_its_own_environment(monkeypatch):
    """The parent's runtime is pinned; a forked child drops it with the runtime."""
    monkeypatch.setenv("NEURONMP_RING_BYTES", "1MiB")
    runtime.init()
    monkeypatch.setenv("NEURONMP_RING_BYTES", "4MiB")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, str(settings.get("ring_bytes")).encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        got = f.read()
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(got) == 4 << 20 and settings.get("ring_bytes") == 1 << 20


def test_importing_the_settings_imports_no_torch():
    code = "import sys, neuronmp.host.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "False"


def test_torchneurons_switches_stay_live_while_a_runtime_is_up(monkeypatch):
    """TorchNeuron reads its switches at each call and its tests flip them while the
    device runs: those fields are never pinned; the others are."""
    rt = runtime.init()
    monkeypatch.setenv("TORCH_NEURONX_RETAIN_DEVICE_MODE", "1")
    monkeypatch.setenv("NEURONMP_RING_BYTES", "1MiB")
    assert settings.get("retain_device_mode") is True
    assert settings.get("ring_bytes") == rt.settings.ring_bytes != 1 << 20
    monkeypatch.setenv("TORCH_NEURONX_ATEN_GMM_ALIGN", "wide")
    with pytest.raises(ConfigError, match="TORCH_NEURONX_ATEN_GMM_ALIGN='wide'"):
        settings.get("gmm_align")
    monkeypatch.delenv("TORCH_NEURONX_RETAIN_DEVICE_MODE")
    assert settings.get("retain_device_mode") is False


#: the package's modules that touch os.environ outside the settings, and why they may
_ENV_OUTSIDE_SETTINGS = {
    # save and restore NEURONMP_PROVIDE around a test session; PATH for the installed tools
    "pytest_plugin.py": {"os.environ.get(ENV_PROVIDE)", "os.environ.get('PATH', '')"},
    # neuronmp-run's NEURONMP_RUN_<OPTION> / PET_<OPTION>: argparse defaults, parsed
    # with each option's own grammar
    "cli/run.py": {"os.environ.get(prefix + dest.upper())"},
}


def _environ_reads(tree):
    """Reads of os.environ in ``tree``: .get(), os.getenv(), os.environ[...] loaded,
    ``in os.environ``; writes (assignment, setdefault, pop) and copies for a child's
    environment (dict(os.environ ...)) are not reads."""
    import ast

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ"
                and isinstance(node.value, ast.Name) and node.value.id == "os")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                yield ast.unparse(node)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):
            yield ast.unparse(node)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield ast.unparse(node)


def test_only_the_settings_read_the_environment():
    import ast
    import pathlib

    root = pathlib.Path(settings.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel in ("settings.py", "envconfig.py"):
            continue
        reads = set(_environ_reads(ast.parse(path.read_text())))
        if reads - _ENV_OUTSIDE_SETTINGS.get(rel, set()):
            found[rel] = sorted(reads - _ENV_OUTSIDE_SETTINGS.get(rel, set()))
    assert not found, f"read the environment through neuronmp.host.settings instead: {found}"


def test_the_environment_check_sees_each_kind_of_read():
    import ast

    code = ("import os\nos.environ.get('A')\nos.getenv('B')\nx = os.environ['C']\n"
            "'D' in os.environ\nos.environ['E'] = '1'\nos.environ.setdefault('F', '1')\n"
            "env = dict(os.environ)\n")
    assert sorted(_environ_reads(ast.parse(code))) == sorted(
        ["os.environ.get('A')", "os.getenv('B')", "os.environ['C']", "'D' in os.environ"])


def test_the_request_is_parsed_again_when_any_variable_it_reads_changes(monkeypatch):
    monkeypatch.setenv("NEURONMP_TOPOLOGY", "4x4")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("NEURONMP_SLICED_BY", raising=False)
    assert settings.get("request").cores == (2, 3)          # torchrun's share
    monkeypatch.setenv("NEURONMP_SLICED_BY", "neuronmp-run")
    assert settings.get("request").cores == (0, 1, 2, 3)    # already sliced: all of them
    assert settings.get("local_share") == (1, 2) and settings.get("visible_cores") == (0, 1, 2, 3)
