"""The device's C++ extension: built on first use, and what is said when it cannot be."""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile


def test_no_compiler_is_a_clear_error(tmp_path):
    proc = run("""
        import json
        from neuronmp.torchneuron import _ext
        try:
            _ext.load()
        except RuntimeError as exc:
            print(json.dumps([type(exc).__name__, exc.needed, str(exc)]))
        """, tmp_path, provide=None, CXX="/nonexistent/c++",
        NEURONMP_TORCHNEURON_CACHE=str(tmp_path / "cache"))
    name, needed, text = facts(proc)
    assert name == "DeviceExtensionError" and needed == "a C++ compiler"
    assert "/nonexistent/c++" in text and "CXX" in text


def test_a_build_says_so_once_on_stderr_and_a_failed_one_says_why(tmp_path):
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\necho 'fake compiler refuses' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = run("""
        import json
        from neuronmp.torchneuron import _ext
        try:
            _ext.load()
        except RuntimeError as exc:
            print(json.dumps([type(exc).__name__, exc.needed]))
        """, tmp_path, provide=None, CXX=str(fake),
        NEURONMP_TORCHNEURON_CACHE=str(tmp_path / "cache"))
    assert facts(proc) == ["DeviceExtensionError", "its C++ extension compiled"]
    said = [line for line in proc.stderr.splitlines() if line.startswith("neuronmp: ")]
    assert len(said) == 1 and "compiling the neuron device's C++ extension once" in said[0]
    assert not list((tmp_path / "cache").rglob("*.so"))   # nothing half-built is kept
