"""Running TorchNeuron-style scripts in fresh interpreters with only the variable set.

Each script is run as ``python -c`` with the test's environment (its private runtime
directory and emulated topology) plus ``NEURONMP_PROVIDE=torchneuron``, from a
directory outside the tree (so only the installed package metadata, with its entry
points, is seen).  The last line a script prints is JSON: the test's facts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Optional

import warm_support

PROVIDE = "torchneuron"


def env_with(provide: Optional[str] = PROVIDE, **more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NEURONMP_PROVIDE"}
    if provide is not None:
        env["NEURONMP_PROVIDE"] = provide
    env.update(more)
    return env


def run(code: str, cwd, provide: Optional[str] = PROVIDE, timeout: float = 300,
        **more: str) -> subprocess.CompletedProcess:
    # warm (a fork of an interpreter that imported torch with the same import-time
    # variables) when nothing the script can see differs: see warm_support.py
    return warm_support.run(textwrap.dedent(code), env_with(provide, **more), cwd=str(cwd),
                            timeout=timeout)


def facts(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rank_facts(jobs, timeout: float = 400) -> list:
    """The last JSON line each rank job printed, in rank order, once all have exited 0."""
    found = []
    for job in jobs:
        out, err = job.communicate(timeout=timeout)
        assert job.returncode == 0, err[-4000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def warm_cache() -> None:
    """Compile the device's extension into the user's cache (once: later runs load it)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from neuronmp.torchneuron import _ext; _ext.load()"],
        capture_output=True, text=True, timeout=900, env=env_with(None), cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
