"""Models and helpers the pool tests share (tests/pool/*)."""
from __future__ import annotations

import io
import os
import time

import torch

from neuronmp.host import procid
from neuronmp.ipc.ring import _SLICE as RING_SLICE


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch.relu(x @ self.w) + 1


def script_bytes(module, example=None):
    mod = torch.jit.script(module) if example is None else torch.jit.trace(module, example)
    buf = io.BytesIO()
    torch.jit.save(mod, buf)
    return buf.getvalue(), mod



def run_on_a_small_tmpfs(procs, tmp_path, script: str, megabytes: int, *,
                         as_tmpdir: bool = False, options: str = "") -> dict:
    """Run ``script`` (it prints one JSON object) with a runtime directory (or, with
    ``as_tmpdir``, its TMPDIR) on a tmpfs of ``megabytes`` MiB mounted with ``options``
    in a private mount namespace, so nothing outlives the test, and a 1 MiB ring on
    core 0; its JSON.  Skips without root and ``unshare -m``."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs root and unshare -m to mount a small tmpfs")
    path = tmp_path / "script.py"
    path.write_text(script)
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    shell = (f"mount -t tmpfs -o size={megabytes}m,mode=700{options} tmpfs {run_dir} && "
             f"exec {sys.executable} {path}")
    env = {**os.environ, "NEURONMP_RING_BYTES": "1MiB", "NEURON_RT_VISIBLE_CORES": "0"}
    env["TMPDIR" if as_tmpdir else "NEURONMP_RUNTIME_DIR"] = str(run_dir)
    proc = procs.popen(["unshare", "-m", "sh", "-c", shell], env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out)


def wakeup_cpu_seconds(sleeps: int = 8) -> float:
    """CPU seconds this process spends per wake-up from a sleep of one ring slice: at
    least what an idle worker's liveness check costs on this host (microseconds on a
    bare CPU, over a millisecond on some VMs)."""
    before = procid.cpu_seconds(os.getpid())
    for _ in range(sleeps):
        time.sleep(RING_SLICE)
    return (procid.cpu_seconds(os.getpid()) - before) / sleeps
