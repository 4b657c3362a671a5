"""A throwaway venv whose site-packages holds the NEURONMP_PROVIDE hook's .pth file, as
an install of neuronmp puts it there; children run with the tree under test first on
PYTHONPATH.

torch and the rest come from the environment running the tests, which may itself be a
virtualenv: ``--system-site-packages`` would only reach the base interpreter's
site-packages, so the throwaway venv gets a .pth that adds the running environment's
site directories (with their own .pth files, as a site directory's are).
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = "_neuronmp_provide.pth"


#: Sorted before ``_neuronmp_provide.pth`` (site reads .pth files in name order), so
#: torch is importable by the time the hook runs.
OUTER_PTH = "00-outer-environment.pth"


def _outer_site_dirs() -> list:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def make_venv(where) -> str:
    """Create the venv in ``where``, seeing this environment's packages; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)
    python = os.path.join(str(where), "bin", "python")
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                         check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(own, OUTER_PTH), "w") as f:
        f.write("import site; " + "; ".join(f"site.addsitedir({d!r})"
                                            for d in _outer_site_dirs()) + "\n")
    shutil.copy(os.path.join(ROOT, PTH), own)
    return python


def env_for(provide=None, extra_path=(), **more) -> dict:
    """The test's environment, NEURONMP_PROVIDE as given, the tree first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "NEURONMP_PROVIDE"}
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, ROOT])
    if provide is not None:
        env["NEURONMP_PROVIDE"] = provide
    env.update(more)
    return env
