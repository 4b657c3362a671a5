"""Draw docs/guides/img/monitoring.png from a real run: applications on an emulated
trn1.32xlarge, neuronmp-monitor's Prometheus endpoint, a real Prometheus server
scraping it every second, and two PromQL range queries.

    python tools/plot_monitoring.py [--out docs/guides/img/monitoring.png] [--seconds 40]

The applications run device-time models (NEURONMP_DEVICE_TIME_US), so their cores'
utilization is what their schedule asks, whatever the host's CPUs are doing:

    serve_a  cores 0-1  10 ms of device time every 10 ms, the cores in turn (50 % each)
    serve_b  core 2     every 40 ms, then every 13.3 ms from half-time   (25 % -> 75 %)
    (pid)    core 3     its model loaded, never run                       (0 %)

Needs the ``prometheus`` binary (Debian's package) and matplotlib (the ``bench`` extra).
Every process it starts is stopped before it exits, and its runtime directory removed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_APP = r"""
import sys, threading, time, torch, neuronmp
model = neuronmp.trace(torch.nn.Linear(256, 256), torch.zeros(8, 256))
if {every}:
    neuronmp.set_multicore(model)
x = torch.rand(8, 256)
model(x)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
start = tick = time.monotonic()
while not stop.is_set():
    if {cycles}:
        cycle = {cycles}[0] if time.monotonic() - start < {switch} else {cycles}[1]
        model(x)
        tick += cycle
        stop.wait(max(0.0, tick - time.monotonic()))
    else:
        stop.wait(0.1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "guides", "img",
                                                  "monitoring.png"))
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args(argv)
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("plot_monitoring: needs the prometheus binary (apt-get install prometheus)",
              file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="nmp-monitoring-")
    env = dict(os.environ, NEURONMP_TOPOLOGY="trn1.32xlarge",
               NEURONMP_RUNTIME_DIR=os.path.join(work, "rt"), NEURONMP_DEVICE_TIME_US="10000")
    os.mkdir(env["NEURONMP_RUNTIME_DIR"], 0o700)
    started = []

    def start(argv, extra=None, **kw):
        proc = subprocess.Popen(argv, env=dict(env, **(extra or {})), text=True, **kw)
        started.append(proc)
        return proc

    try:
        apps = [("0-1", "serve_a", True, (0.01, 0.01)), ("2", "serve_b", False, (0.04, 0.0133)),
                ("3", None, False, ())]
        procs = []
        for cores, tag, every, cycles in apps:
            extra = {"NEURON_RT_VISIBLE_CORES": cores}
            if tag:
                extra["NEURON_PROCESS_TAG"] = tag
            code = _APP.format(every=every, cycles=cycles, switch=args.seconds / 2)
            procs.append(start([sys.executable, "-c", code], extra, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE))
        for proc in procs:
            assert proc.stdout.readline().startswith("ready")
        conf = os.path.join(work, "monitor.conf")
        with open(conf, "w") as f:
            json.dump({"period": "1s", "neuron_runtimes": [{"metrics": [
                {"type": "neuroncore_counters"}, {"type": "execution_stats"}]}]}, f)
        monitor = start([sys.executable, "-m", "neuronmp.cli.monitor", "-c", conf,
                         "--prometheus-port", "0"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE)
        target = re.search(r"http://(\S+)/metrics", monitor.stderr.readline()).group(1)
        port = _free_port()
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: neuron\n"
                    f"    static_configs:\n      - targets: ['{target}']\n")
        start([prometheus, f"--config.file={work}/prometheus.yml",
               f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{port}"],
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        time.sleep(args.seconds)
        api = f"http://127.0.0.1:{port}/api/v1/query_range?"
        span = {"start": t0, "end": time.time(), "step": "1"}
        util = _get(api + urllib.parse.urlencode(
            {"query": "neuroncore_utilization_ratio", **span}))["data"]["result"]
        lat = _get(api + urllib.parse.urlencode(
            {"query": 'execution_latency_seconds{percentile=~"p50|p99"}', **span}))
        _draw(util, lat["data"]["result"], t0, args.out)
        print(f"wrote {args.out}")
    finally:
        for proc in started:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in reversed(started):
            if proc.stdin is None:
                proc.terminate()
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _draw(util: list, latency: list, t0: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for series in sorted(util, key=lambda s: int(s["metric"]["neuroncore"])):
        m = series["metric"]
        xs = [float(t) - t0 for t, _ in series["values"]]
        ys = [100 * float(v) for _, v in series["values"]]
        top.plot(xs, ys, label=f"nc{m['neuroncore']} ({m['runtime_tag']})")
    top.set_ylabel("neuroncore_utilization_ratio (%)")
    top.set_ylim(-5, 105)
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    top.set_title("neuronmp-monitor on an emulated trn1.32xlarge, scraped by Prometheus (1 s)")
    for series in sorted(latency, key=lambda s: (s["metric"]["runtime_tag"],
                                                 s["metric"]["percentile"])):
        m = series["metric"]
        xs = [float(t) - t0 for t, _ in series["values"]]
        ys = [1000 * float(v) for _, v in series["values"]]
        bottom.plot(xs, ys, label=f"{m['runtime_tag']} {m['percentile']}")
    bottom.set_ylabel("execution_latency_seconds (ms)")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    bottom.grid(alpha=0.3)
    fig.text(0.01, 0.005, f"measured {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
             f"load average {os.getloadavg()[0]:.1f}; python tools/plot_monitoring.py",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
