"""Benchmark: neuronmp.DataParallel against in-process TorchScript and the physical ceiling.

For an MLP (512-1024-1024-10) and a small conv net on 3x64x64 images, at batch 1, 8, 64:

  torch 1t    the same TorchScript model (torch.jit.trace) in this process, 1 thread
  torch Nt    the same, with as many threads as there are cores
  DP 1 core   neuronmp.DataParallel on nc:0 only
  DP all      neuronmp.DataParallel on every visible core (traced at the per-core batch)
  ceiling     one independent, pinned, single-thread process per core running the
              per-core batch with no communication at all; their summed throughput

Throughput is samples/s; "lat" columns are the median time of one call at batch 1.
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
from neuronmp import runtime

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


MODELS = {"mlp": (mlp, (512,)), "conv": (convnet, (3, 64, 64))}


def _measure(fn, batch: int, seconds: float):
    """(samples/s, median seconds per call) of fn() run for about ``seconds``."""
    warm_until = time.perf_counter() + min(0.3, seconds / 4)
    while time.perf_counter() < warm_until:  # caches, allocator and spin heuristics settle
        fn()
    times = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 > end:
            break
    return batch * len(times) / sum(times), statistics.median(times)


def _in_process(model, shape, batch, threads, seconds):
    torch.set_num_threads(threads)
    x = torch.rand(batch, *shape)
    with torch.no_grad():
        torch.jit.trace(model, x)(x)  # past the slow first trace (see _CEILING)
        ts = torch.jit.trace(model, x)
        return _measure(lambda: ts(x), batch, seconds)


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
        while time.time() < {start}:
            time.sleep(0.0005)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < {seconds}:
            ts(x)
            n += 1
        print(json.dumps({batch} * n / (time.perf_counter() - t0)))
""")


def _ceiling(name, model, batch, cpus_per_core, seconds, workdir):
    """Summed samples/s of one pinned single-thread process per core, started together."""
    weights = os.path.join(workdir, f"{name}.pt")
    torch.save(model.state_dict(), weights)
    start = time.time() + 3.0       # everyone imports torch first, then runs at once
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CEILING.format(
                tools=os.path.dirname(os.path.abspath(__file__)), cpus=list(cpus), name=name,
                weights=weights, batch=batch, start=start, seconds=seconds)],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        for cpus in cpus_per_core
    ]
    total = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"ceiling process failed with exit code {p.returncode}")
        total += json.loads(out.strip().splitlines()[-1])
    return total


def _dp(model, shape, batch, device_ids, seconds):
    per_core = max(1, -(-batch // len(device_ids)))
    traced = neuronmp.trace(model, torch.rand(per_core, *shape))
    dp = neuronmp.DataParallel(traced, device_ids=device_ids)
    x = torch.rand(batch, *shape)
    expected = model(x)
    got = dp(x)
    if not torch.allclose(got, expected.detach(), atol=1e-4):
        raise AssertionError("DataParallel result differs from plain torch")
    return _measure(lambda: dp(x), batch, seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--models", default="mlp,conv")
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
                per_core = max(1, -(-batch // n))
                r = {"model": name, "batch": batch}
                r["t1"], r["lat_t1"] = _in_process(model, shape, batch, 1, args.seconds)
                r["tn"], r["lat_tn"] = _in_process(model, shape, batch, n, args.seconds)
                torch.set_num_threads(1)
                r["dp1"], r["lat_dp1"] = _dp(model, shape, batch, [0], args.seconds)
                r["dpn"], r["lat_dpn"] = _dp(model, shape, batch, list(range(n)), args.seconds)
                used = cpus[: min(n, batch)]
                r["ceil"] = _ceiling(name, model, per_core, used, args.seconds, workdir)
                rows.append(r)
                print(f"  measured {name} batch {batch}", file=sys.stderr, flush=True)
    _print_table(rows, n)
    neuronmp.shutdown()
    return 0


def _print_table(rows, n):
    print(f"\nneuronmp DataParallel on {n} core(s) (one CPU each); samples/s\n")
    head = (f"{'model':5} {'batch':>5} {'torch 1t':>9} {f'torch {n}t':>9} {'DP 1core':>9} "
            f"{'DP all':>9} {'ceiling':>9} {'DP/ceil':>8} {'DP/1t':>6} {f'DP/{n}t':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:5} {r['batch']:>5} {r['t1']:>9.0f} {r['tn']:>9.0f} {r['dp1']:>9.0f} "
              f"{r['dpn']:>9.0f} {r['ceil']:>9.0f} {r['dpn'] / r['ceil']:>8.2f} "
              f"{r['dpn'] / r['t1']:>6.2f} {r['dpn'] / r['tn']:>6.2f}")
    print("\nbatch-1 latency (median of one call, microseconds)\n")
    print(f"{'model':5} {'torch 1t':>9} {f'torch {n}t':>9} {'DP 1core':>9} {'DP all':>9} "
          f"{'DP - 1t':>8}")
    for r in rows:
        if r["batch"] != 1:
            continue
        us = {k: r[k] * 1e6 for k in ("lat_t1", "lat_tn", "lat_dp1", "lat_dpn")}
        print(f"{r['model']:5} {us['lat_t1']:>9.0f} {us['lat_tn']:>9.0f} {us['lat_dp1']:>9.0f} "
              f"{us['lat_dpn']:>9.0f} {us['lat_dpn'] - us['lat_t1']:>+8.0f}")
    print("\nceiling: one pinned single-thread process per core, each running the per-core "
          "batch with no communication (summed).")


if __name__ == "__main__":
    sys.exit(main())
