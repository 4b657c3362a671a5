"""``python -m neuronmp``: the main demo on the emulated default host.

Traces an MLP (512-1024-1024-10), runs it with DataParallel over every visible core (one worker
process per core), checks the results against plain torch, and prints throughput
against the same TorchScript model in this single process.

    trace(model) ──▶ DataParallel(trace) ──▶ batch split over nc:0..nc:N-1 ──▶ compare
"""
from __future__ import annotations

import sys
import time


def _throughput(fn, batch: int, seconds: float = 1.0) -> float:
    for _ in range(3):
        fn()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return batch * calls / (time.perf_counter() - t0)


def main() -> int:
    import torch

    import neuronmp
    from neuronmp import runtime

    rt = runtime.get_runtime()
    n = len(rt.cores)
    topo = rt.topology
    print(f"emulated host: {topo.name}, {topo.chips} chip(s) x {topo.cores_per_chip} core(s); "
          f"this process owns global core(s) {list(rt.cores)} as nc:0-nc:{n - 1}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10)).eval()
    batch = 32 * n
    per_core = batch // n
    t0 = time.perf_counter()
    traced = neuronmp.trace(model, torch.rand(per_core, 512))
    parallel = neuronmp.DataParallel(traced)
    print(f"traced a 512-1024-1024-10 MLP at batch {per_core} and loaded it on {n} core(s) "
          f"in {time.perf_counter() - t0:.1f} s")

    x = torch.rand(batch, 512)
    with torch.no_grad():
        expected = model(x)
    got = parallel(x)
    ok = torch.allclose(got, expected, atol=1e-5)
    print(f"DataParallel output {tuple(got.shape)} matches plain torch: {ok}")

    torch.set_num_threads(1)
    with torch.no_grad():
        single = torch.jit.trace(model, x)
        base = _throughput(lambda: single(x), batch)
    dp = _throughput(lambda: parallel(x), batch)
    print(f"throughput at batch {batch}: single-process torch (1 thread) {base:,.0f} samples/s, "
          f"DataParallel on {n} core(s) {dp:,.0f} samples/s ({dp / base:.2f}x)")
    neuronmp.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
