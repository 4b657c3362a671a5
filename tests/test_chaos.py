"""The bounded chaos run (tools/chaos.py): threads, asyncio, DataParallel and a
BatchingServer under load while workers are SIGKILLed and SIGSTOPped at random.

Every request must be answered with exactly x*2+1 or fail with a named neuronmp
error; none may hang; nothing may be left.  Bounded here to 6 s of chaos (kills for
the first 3 s, then the stopped workers are replaced); NEURONMP_CHAOS_SECONDS runs it
longer, and tools/chaos.py runs 20 s by default.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "chaos.py"


def test_chaos_no_wrong_answer_no_hang_no_leak(procs, runtime_dir):
    seconds = os.environ.get("NEURONMP_CHAOS_SECONDS", "6")
    p = procs.popen([sys.executable, str(TOOL), "--seconds", seconds],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "NEURONMP_TOPOLOGY": "1x3",
                         "NEURON_RT_EXEC_TIMEOUT": "2"})
    out, err = p.communicate(timeout=float(seconds) + 120)
    report = json.loads(out.splitlines()[-1]) if out.strip() else None
    assert report is not None, err[-3000:]
    assert report["signals"].get("SIGKILL", 0) + report["signals"].get("SIGSTOP", 0) > 0
    assert report["ok"] > 0 and report["requests"] == report["ok"] + report["failed"]
    assert (report["wrong"], report["unexpected"], report["hung"], report["hung_threads"]) == \
        (0, {}, 0, 0), report
    assert report["leaks"] == [] and not os.path.exists(runtime_dir), report
    assert p.returncode == 0, err[-3000:]
