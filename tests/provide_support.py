"""A throwaway venv whose site-packages holds the NEURONMP_PROVIDE hook's .pth file, as
an install of neuronmp puts it there (system site-packages visible: torch and the rest
come from the test environment); children run with the tree under test first on
PYTHONPATH."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = "_neuronmp_provide.pth"


def make_venv(where) -> str:
    """Create the venv in ``where``; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(where)], check=True, timeout=120)
    python = os.path.join(str(where), "bin", "python")
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    shutil.copy(os.path.join(ROOT, PTH), site)
    return python


def env_for(provide=None, extra_path=(), **more) -> dict:
    """The test's environment, NEURONMP_PROVIDE as given, the tree first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "NEURONMP_PROVIDE"}
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, ROOT])
    if provide is not None:
        env["NEURONMP_PROVIDE"] = provide
    env.update(more)
    return env
