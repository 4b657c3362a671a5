"""The test harness's own promises: what a killed test run leaves is swept by the next."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KILLED_OWNER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from tests import warm_support
t = warm_support.Template(dict(os.environ))
print(t.runtime_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_runs_warm_template_directory_is_swept_at_the_next_session_start(request):
    res = subprocess.run([sys.executable, "-c", _KILLED_OWNER, ROOT], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr
    left = res.stdout.strip()
    assert os.path.isdir(left), "the killed owner's directory should still be there"
    # the root conftest as pytest loaded it (its module name depends on the import mode)
    root = os.path.join(ROOT, "conftest.py")
    conftest = next((p for p in request.config.pluginmanager.get_plugins()
                     if getattr(p, "__file__", None) == root), None)
    if conftest is None:
        pytest.fail(f"{root} is not among pytest's plugins")
    conftest.pytest_sessionstart(None)
    assert not os.path.exists(left), f"{left} outlived its killed owner's sweep"
