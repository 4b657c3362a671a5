"""The BatchingServer's threads' path, step by step, on device-time cores.

--clients threads call ``server.infer`` on a one-row sample in a loop for --seconds
against a model of --cost-us per batch of 32 rows on --cores emulated cores; the
steps of the path are timed where they run (the driver's methods wrapped, private
parts on purpose: what is timed is each step, not a new way of doing it):

  submit        a caller's check and queueing (and the batch's send when its
                request completes one), per request
  send          a batch stacked, padded and handed to ``Route.send``, per batch
  done          a batch's answer handled by the thread that read it: each caller
                settled and woken, the slot freed, the next due batch sent
  settle        of that, settling and waking, per request
  wake-up       from a request's settling to its caller running again
  round trip    a caller's whole ``infer``

Each core count runs in a fresh process on an emulated host of that many cores:

    python tools/bench_threadpath.py --cores 2,8 --clients 64,256
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent("""
    import json, statistics, sys, threading, time, torch, neuronmp
    from neuronmp.batching import BatchingServer
    from neuronmp.batching import threads as paths
    cost, seconds, clients = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    pc = time.perf_counter_ns
    steps = {k: [] for k in ("submit", "send", "done", "settle", "wake", "trip")}
    settled = {}
    driver = paths.ThreadDriver

    def timed(name, per_batch_of=None):
        original = getattr(driver, name)
        def wrapper(self, batch, *args):
            t0 = pc()
            if name == "_settle":
                for req in batch:
                    settled[id(req.future)] = t0
            out = original(self, batch, *args)
            took = pc() - t0
            steps[{"_send": "send", "_done": "done", "_settle": "settle"}[name]].append(
                took / len(batch) if name == "_settle" else took)
            return out
        setattr(driver, name, wrapper)

    for name in ("_send", "_done", "_settle"):
        timed(name)
    net = torch.nn.Linear(16, 4).eval()
    traced = neuronmp.trace(net, torch.rand(32, 16), device_time=cost)
    neuronmp.set_multicore(traced)
    server = BatchingServer(traced, max_batch_size=32, max_queue_delay_ms=0.1)
    sample = torch.rand(1, 16)
    stop = [float("inf")]
    ready = threading.Barrier(clients + 1)

    def caller():
        ready.wait()
        while time.perf_counter() < stop[0]:
            t0 = pc()
            req = server._enqueue((sample,), None, paths.Claimed(), None, None)
            t1 = pc()
            req.future.result()
            t2 = pc()
            steps["submit"].append(t1 - t0)
            steps["trip"].append(t2 - t0)
            s = settled.pop(id(req.future), None)
            if s is not None:
                steps["wake"].append(t2 - s)

    server.infer(sample)
    threads = [threading.Thread(target=caller) for _ in range(clients)]
    for t in threads: t.start()
    ready.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    stop[0] = t0 + seconds
    for t in threads: t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = server.stats()
    server.close()
    neuronmp.shutdown()
    n = len(steps["trip"])
    out = {"cores": neuronmp.core_count(), "clients": clients, "rps": n / wall,
           "cpu_us": cpu / max(n, 1) * 1e6, "rows": stats["mean_batch_rows"]}
    for k, v in steps.items():
        v.sort()
        out[k] = (statistics.median(v) / 1e3, v[int(len(v) * 0.9)] / 1e3) if v else (0, 0)
    print(json.dumps(out))
""")


def measure(cores: int, clients: int, cost_us: float, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir="/dev/shm") as rundir:
        env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir,
                   NEURONMP_TOPOLOGY=f"{max(1, cores // 2)}x{min(cores, 2)}")
        env.pop("NEURON_RT_VISIBLE_CORES", None)
        env.pop("NEURON_RT_NUM_CORES", None)
        res = subprocess.run([sys.executable, "-c", _CHILD, str(cost_us), str(seconds),
                              str(clients)], env=env, capture_output=True, text=True,
                             timeout=600)
    if res.returncode:
        raise SystemExit(f"{cores} cores failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="2,8")
    ap.add_argument("--clients", default="64,256", help="per core count, in order")
    ap.add_argument("--cost-us", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    clients += [clients[-1]] * (len(cores) - len(clients))
    rows = [measure(n, k, args.cost_us, args.seconds) for n, k in zip(cores, clients)]
    print(f"\nThe threads' path step by step ({args.cost_us:g} us per batch of 32 rows): "
          "median / p90 us (see the module docstring)\n")
    head = (f"{'cores':>5} {'callers':>7} {'req/s':>7} {'CPU us/req':>10} {'rows/batch':>10} "
            + " ".join(f"{k:>13}" for k in ("submit", "send", "done", "settle", "wake-up",
                                            "round trip")))
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(f"{r[k][0]:>6.0f}/{r[k][1]:<6.0f}" for k in
                         ("submit", "send", "done", "settle", "wake", "trip"))
        print(f"{r['cores']:>5} {r['clients']:>7} {r['rps']:>7.0f} {r['cpu_us']:>10.1f} "
              f"{r['rows']:>10.1f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
