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
