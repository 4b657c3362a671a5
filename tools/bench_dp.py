"""Benchmark: neuronmp.DataParallel against in-process TorchScript and the physical ceiling.

For an MLP (512-1024-1024-10) and a small conv net on 3x64x64 images (and, with
``--models stem224``, a conv stem on 3x224x224 images, whose chunks travel on the
rings' spill arenas), at batch 1, 8, 64:

  torch 1t    the same TorchScript model (torch.jit.trace) in this process, 1 thread
  torch Nt    the same, with as many threads as there are cores
  DP 1 core   neuronmp.DataParallel on nc:0 only
  DP all      neuronmp.DataParallel on every visible core (traced at the per-core batch)
  ceiling     one independent, pinned, single-thread process per core running the
              per-core batch with no communication at all; their summed throughput

Throughput is samples/s (median of ``--rounds`` rounds in which every column runs in
turn, so that all of them see the same moments of a noisy host); "lat" columns are
the median time of one call at batch 1.
Run on the default emulated host (one core per CPU):  python tools/bench_dp.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch

import neuronmp
from neuronmp.host import runtime
from neuronmp.session.session import current as _current_session

BATCHES = (1, 8, 64)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).eval()


def convnet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).eval()


def stem224() -> torch.nn.Module:
    """A ResNet-like stem on 3x224x224 images (the Neuron SDK examples' input size):
    a chunk of 8 is 4.7 MiB, over half a default ring, so it travels on a spill arena."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, stride=4, padding=3), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    ).eval()


MODELS = {"mlp": (mlp, (512,)), "conv": (convnet, (3, 64, 64)), "stem224": (stem224, (3, 224, 224))}


_WARM = 3


def _timed(fn, seconds: float, warm: int = _WARM):
    """Per-call times of fn() for about ``seconds``, after ``warm`` untimed calls."""
    for _ in range(warm):
        fn()
    times = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 > end:
            return times


def _in_process(model, shape, batch):
    """A callable running the TorchScript model in this process."""
    x = torch.rand(batch, *shape)
    with torch.no_grad():
        torch.jit.trace(model, x)(x)  # past the slow first trace (see _CEILING)
        ts = torch.jit.trace(model, x)

    def call():
        with torch.no_grad():
            ts(x)
    return call


_CEILING = textwrap.dedent("""
    import os, sys, time, json, torch
    sys.path.insert(0, {tools!r})
    import bench_dp
    os.sched_setaffinity(0, {cpus!r})
    torch.set_num_threads(1)
    factory, shape = bench_dp.MODELS[{name!r}]
    model = factory()
    model.load_state_dict(torch.load({weights!r}))
    x = torch.rand({batch}, *shape)
    with torch.no_grad():
        # the first traced conv net of a process runs at half speed (seen with torch
        # 2.13 on CPU, whatever the batch); the bench process and the workers are past
        # it, so the ceiling is measured past it too
        for _ in range(3):
            torch.jit.trace(model, x)(x)
        ts = torch.jit.trace(model, x)
        for _ in range(3):
            ts(x)
        print("ready", flush=True)
        for line in sys.stdin:          # "<start time> <seconds>": one measurement
            start, seconds = map(float, line.split())
            while time.time() < start:
                time.sleep(0.0005)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                ts(x)
                n += 1
            print(json.dumps({batch} * n / (time.perf_counter() - t0)), flush=True)
""")


class _Ceiling:
    """One pinned single-thread process per core, idle between measurements, so that
    the ceiling is measured in the same rounds as the other columns."""

    def __init__(self, name, model, batch, cpus_per_core, workdir):
        weights = os.path.join(workdir, f"{name}.pt")
        torch.save(model.state_dict(), weights)
        tools = os.path.dirname(os.path.abspath(__file__))
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CEILING.format(
                    tools=tools, cpus=list(cpus), name=name, weights=weights, batch=batch)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
            for cpus in cpus_per_core
        ]
        for p in self.procs:
            if p.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError(f"ceiling process failed with exit code {p.wait()}")

    def measure(self, seconds: float) -> float:
        """Summed samples/s of all of them, running at once for ``seconds``."""
        start = time.time() + 0.02
        for p in self.procs:
            p.stdin.write(f"{start} {seconds}\n")
            p.stdin.flush()
        return sum(json.loads(p.stdout.readline()) for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _dp(model, shape, batch, device_ids, traced_batch=None):
    """A callable running DataParallel on ``device_ids`` (checked against torch once),
    on a model traced at the per-core batch, or at ``traced_batch`` (the SDK pages
    trace at batch 1 and let dynamic batching cut the input)."""
    per_core = traced_batch or max(1, -(-batch // len(device_ids)))
    traced = neuronmp.trace(model, torch.rand(per_core, *shape))
    dp = neuronmp.DataParallel(traced, device_ids=device_ids)
    x = torch.rand(batch, *shape)
    expected = model(x)
    got = dp(x)
    if not torch.allclose(got, expected.detach(), atol=1e-4):
        raise AssertionError("DataParallel result differs from plain torch")

    return lambda: dp(x)


def _row(name, model, shape, batch, n, cpus, seconds, rounds, workdir):
    """Every column of one table row, measured in ``rounds`` interleaved rounds: the
    host's load drifts over seconds, and a ratio of columns measured minutes apart
    (or even one after the other) carries that drift."""
    per_core = max(1, -(-batch // n))
    threads = {"t1": 1, "tn": n, "dp1": 1, "dpn": 1, "dpb1": 1}   # this process's threads
    calls = {"t1": _in_process(model, shape, batch),
             "tn": _in_process(model, shape, batch),
             "dp1": _dp(model, shape, batch, [0]),
             "dpn": _dp(model, shape, batch, list(range(n))),
             "dpb1": _dp(model, shape, batch, list(range(n)), traced_batch=1)}
    ceiling = _Ceiling(name, model, per_core, cpus[: min(n, batch)], workdir)
    times = {k: [] for k in calls}
    rates = {k: [] for k in (*calls, "ceil")}
    pool = _current_session().pool
    busy = []   # per round: the DP-all workers' mean compute per call, seconds
    caller = []  # per round: this process's CPU seconds per DP-all call (all its threads)
    try:
        for k, fn in calls.items():          # caches, allocator and spin heuristics settle
            torch.set_num_threads(threads[k])
            _timed(fn, min(0.3, seconds / 4))
        for _ in range(rounds):
            for k, fn in calls.items():
                torch.set_num_threads(threads[k])
                before, cpu = pool.stats(), time.process_time()
                t = _timed(fn, seconds / rounds)
                cpu = time.process_time() - cpu
                times[k] += t
                rates[k].append(batch * len(t) / sum(t))
                if k == "dpn":
                    busy.append(_busy_per_call(before, pool.stats(), len(t) + _WARM))
                    caller.append(cpu / (len(t) + _WARM))
            rates["ceil"].append(ceiling.measure(seconds / rounds))
    finally:
        ceiling.close()
        torch.set_num_threads(1)
    r = {"model": name, "batch": batch}
    r.update({k: statistics.median(v) for k, v in rates.items()})
    r.update({f"lat_{k}": statistics.median(v) for k, v in times.items()})
    # where DP's gap to the ceiling goes: the workers' compute per call against
    # the ceiling's time per call (same per-core batch), and against DP's call time
    r["busy"] = statistics.median(busy)
    r["caller"] = statistics.median(caller)
    return r


def _busy_per_call(before, after, calls: int) -> float:
    """Mean compute seconds per call over the cores that ran requests in between."""
    used = [(b.busy_ns - a.busy_ns) / 1e9 for a, b in zip(before, after) if b.done > a.done]
    return sum(used) / len(used) / calls if used else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per column and row")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds the seconds are split into (median)")
    parser.add_argument("--models", default="mlp,conv",
                        help=f"comma list of {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    import tempfile

    rt = runtime.get_runtime()
    n = len(rt.cores)
    cpus = [rt.topology.cpus_of(c) for c in rt.cores]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            factory, shape = MODELS[name]
            model = factory()
            for batch in BATCHES:
                rows.append(_row(name, model, shape, batch, n, cpus, args.seconds,
                                 args.rounds, workdir))
                print(f"  measured {name} batch {batch}", file=sys.stderr, flush=True)
    _print_table(rows, n)
    neuronmp.shutdown()
    return 0


def _print_table(rows, n):
    print(f"\nneuronmp DataParallel on {n} core(s) (one CPU each); samples/s\n")
    head = (f"{'model':7} {'batch':>5} {'torch 1t':>9} {f'torch {n}t':>9} {'DP 1core':>9} "
            f"{'DP all':>9} {'ceiling':>9} {'DP/ceil':>8} {'DP/1t':>6} {f'DP/{n}t':>6} "
            f"{'DP b1':>9} {'b1/DP':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:7} {r['batch']:>5} {r['t1']:>9.0f} {r['tn']:>9.0f} {r['dp1']:>9.0f} "
              f"{r['dpn']:>9.0f} {r['ceil']:>9.0f} {r['dpn'] / r['ceil']:>8.2f} "
              f"{r['dpn'] / r['t1']:>6.2f} {r['dpn'] / r['tn']:>6.2f} "
              f"{r['dpb1']:>9.0f} {r['dpb1'] / r['dpn']:>6.2f}")
    print("\nDP b1: DataParallel on all cores of the same model traced at batch 1 (the SDK "
          "pages' example); b1/DP: its rate over DP all's (traced at the per-core batch).")
    print("\nbatch-1 latency (median of one call, microseconds)\n")
    print(f"{'model':7} {'torch 1t':>9} {f'torch {n}t':>9} {'DP 1core':>9} {'DP all':>9} "
          f"{'DP - 1t':>8}")
    for r in rows:
        if r["batch"] != 1:
            continue
        us = {k: r[k] * 1e6 for k in ("lat_t1", "lat_tn", "lat_dp1", "lat_dpn")}
        print(f"{r['model']:7} {us['lat_t1']:>9.0f} {us['lat_tn']:>9.0f} {us['lat_dp1']:>9.0f} "
              f"{us['lat_dpn']:>9.0f} {us['lat_dpn'] - us['lat_t1']:>+8.0f}")
    print("\nwhere DP all's time goes (milliseconds per call, medians over the rounds)\n")
    print(f"{'model':7} {'batch':>5} {'DP call':>8} {'compute':>8} {'ceiling':>8} "
          f"{'compute/DP':>11} {'compute/ceil':>13} {'caller CPU':>11}")
    for r in rows:
        procs = min(n, r["batch"])
        per_core = max(1, -(-r["batch"] // n))
        dp_ms = r["batch"] / r["dpn"] * 1e3
        ceil_ms = per_core * procs / r["ceil"] * 1e3
        busy_ms = r["busy"] * 1e3
        print(f"{r['model']:7} {r['batch']:>5} {dp_ms:>8.2f} {busy_ms:>8.2f} {ceil_ms:>8.2f} "
              f"{busy_ms / dp_ms:>11.2f} {busy_ms / ceil_ms:>13.2f} {r['caller'] * 1e3:>11.2f}")
    print("\nceiling: one pinned single-thread process per core, each running the per-core "
          "batch with no communication (summed).\ncompute: the time a DP-all worker spends "
          "in the model per call; the rest of a DP call is transport and waiting.\ncaller CPU: "
          "this process's CPU time per DP-all call. From batch 8 on it is taken from the CPUs the "
          "workers compute on;\nat batch 1 only one core is used and the caller mostly spins on "
          "the spare CPU while it waits.")


if __name__ == "__main__":
    sys.exit(main())
