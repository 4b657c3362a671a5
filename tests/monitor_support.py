"""What the neuronmp-monitor tests share: applications that hold cores and run a model, and
a monitor whose reports are read line by line."""
from __future__ import annotations

import json
import subprocess
import sys
import time

#: an application: a Linear(64, 64) traced onto its first core (``every``: on each of its
#: cores, round robin), run ``mode``: "busy" in a loop, "idle" never after its warm-up,
#: "duty" for ``run_s`` of every ``cycle_s``; it prints "ready" after the warm-up and
#: exits cleanly when its stdin closes
APP = r"""
import os, sys, threading, time, torch, neuronmp
mode, every = {mode!r}, {every!r}
model = neuronmp.trace(torch.nn.Linear(64, 64), torch.zeros(4, 64))
if every:
    neuronmp.set_multicore(model)
x = torch.rand(4, 64)
for _ in range(8):
    model(x)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", os.getpid(), flush=True)
tick = time.monotonic()
while not stop.is_set():
    if mode == "busy":
        model(x)
    elif mode == "duty":
        model(x)                      # the core's modelled time: NEURONMP_DEVICE_TIME_US
        tick += {cycle_s!r}
        stop.wait(max(0.0, tick - time.monotonic()))
    else:
        stop.wait(0.05)
"""

#: the weights of APP's model, in bytes: a 64x64 float32 weight and 64 biases
WEIGHT_BYTES = (64 * 64 + 64) * 4


def start_app(procs, cores: str, mode: str = "busy", tag=None, every=False, env=None,
              cycle_s: float = 0.04) -> subprocess.Popen:
    """An application on ``cores`` (NEURON_RT_VISIBLE_CORES), started and warmed up."""
    extra = {"NEURON_RT_VISIBLE_CORES": cores, **(env or {})}
    if tag is not None:
        extra["NEURON_PROCESS_TAG"] = tag
    proc = procs.python(APP.format(mode=mode, every=every, cycle_s=cycle_s), env=extra,
                        stdin=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line.startswith("ready"), proc.stderr.read()[-3000:]
    return proc


def stop_app(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()[-3000:]


def stop_all(*apps: subprocess.Popen) -> None:
    """Stop the applications still running, cleanly (their runtimes remove their
    segments): what a test does whatever happened in it."""
    for proc in apps:
        if proc.poll() is None and not proc.stdin.closed:
            proc.stdin.close()
    for proc in apps:
        proc.wait(timeout=30)


def write_config(tmp_path, doc: dict, name: str = "monitor.conf") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def start_monitor(procs, *args: str) -> subprocess.Popen:
    return procs.popen([sys.executable, "-m", "neuronmp.cli.monitor", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def next_report(monitor: subprocess.Popen) -> dict:
    line = monitor.stdout.readline()
    assert line, f"the monitor ended: {monitor.stderr.read()[-3000:]}"
    return json.loads(line)


def report_until(monitor: subprocess.Popen, ready, timeout: float = 60.0) -> dict:
    """The first report for which ``ready(report)`` is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = next_report(monitor)
        if ready(report):
            return report
    raise AssertionError(f"no report within {timeout} s matched; the last: {report}")


def by_pid(report: dict) -> dict:
    return {app["pid"]: app for app in report["neuron_runtime_data"]}
