"""neuronmp-top: one frame of a running server's cores, JSON and table, no torch."""
from __future__ import annotations

import json
import subprocess
import sys
import time

_SERVER = """
import sys, time, torch, neuronmp
from neuronmp.batching import BatchingServer
model = neuronmp.trace(lambda x: x * 2 + 1, torch.zeros(4, 8))
neuronmp.set_multicore(model)
with BatchingServer(model, 4, 1) as server:
    n = 0
    end = time.monotonic() + 60
    while time.monotonic() < end:
        server.infer(torch.rand(8)); n += 1
        if n == 200:
            print("serving", flush=True)
"""


def _top(*args, env=None, timeout=30):
    return subprocess.run([sys.executable, "-m", "neuronmp.cli.top", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_once_shows_the_cores_of_a_running_server(procs, emulated):
    emulated("1x2")
    server = procs.python(_SERVER, env={"NEURON_RT_VISIBLE_CORES": "1"})
    assert server.stdout.readline().strip() == "serving", server.stderr.read()[-2000:]

    res = _top("--once", "--json", "--interval", "0.3")
    assert res.returncode == 0, res.stderr
    view = json.loads(res.stdout)
    core0, core1 = view["cores"]
    assert view["held"] == 1 and not core0["held"] and core0["requests"] == 0
    assert core1["held"] and core1["holder"]["pid"] == server.pid
    assert core1["worker_pid"] and core1["worker_pid"] != server.pid
    assert core1["requests"] > 0 and core1["requests_per_s"] > 0 and core1["errors"] == 0
    assert 0 < core1["busy_pct"] <= 100

    res = _top("--once", "--interval", "0.2")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "1x2: 2 NeuronCores, 1 held" in lines[0]
    assert lines[2].split()[:4] == ["CORE", "PID", "WORKER", "REQ/S"]
    row = lines[3].split()
    assert row[0] == "1" and row[1] == str(server.pid) and int(row[6]) > 0
    assert len(lines) == 4                      # held cores only, unless --all
    assert len(_top("--once", "--all", "--interval", "0.1").stdout.splitlines()) == 5

    server.terminate()   # the runtime stops the workers and frees the cores on SIGTERM
    server.wait(20)
    deadline = time.monotonic() + 10
    while True:
        view = json.loads(_top("--once", "--json", "--interval", "0.05").stdout)
        if view["held"] == 0 or time.monotonic() > deadline:
            break
    assert view["held"] == 0 and all(c["requests"] == 0 for c in view["cores"])


def test_empty_host_and_live_frames(procs, emulated):
    emulated("1x2")
    res = _top("--once", "--interval", "0.05")
    assert res.returncode == 0, res.stderr
    assert "0 held" in res.stdout and "free" in res.stdout
    live = procs.python("from neuronmp.cli.top import main; main(['--json', '--interval', "
                        "'0.05'])")
    frames = [json.loads(live.stdout.readline()) for _ in range(3)]   # one JSON per line
    assert all(f["held"] == 0 and len(f["cores"]) == 2 for f in frames)


def test_bad_interval_is_refused():
    res = _top("--interval", "0")
    assert res.returncode == 2
    assert "invalid interval '0': expected a number of seconds > 0" in res.stderr


def test_imports_no_torch():
    code = ("import sys; from neuronmp.cli.top import main; "
            "main(['--once', '--interval', '0.01']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
