"""``python -m neuronmp``: the main demo on the emulated default host.

What neuronmp is for, in four steps, each checked:

  1. the emulated host, and the cores this process owns (nc:0 .. nc:N-1)
  2. a second process asking for one of them is refused, naming this process
  3. an MLP traced and run with DataParallel over every core (one worker process
     per core) gives plain torch's results
  4. throughput that means something on any machine: device-time cores (each
     models 10 ms per batch of 32 rows and sleeps meanwhile, as a real NeuronCore
     leaves the host CPU free) on all cores against one core

    trace(model) ──▶ DataParallel(trace) ──▶ batch split over nc:0..nc:N-1 ──▶ compare
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

_COST_US = 10_000  # modelled device time per batch of 32 rows: above the MLP's CPU time
_CALLERS = 4


def _throughput(fn, rows: int, seconds: float = 1.5) -> float:
    """Rows per second with _CALLERS threads calling ``fn`` (``rows`` rows a call)."""
    fn()
    stop = time.perf_counter() + seconds
    counts = [0] * _CALLERS

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            fn()
            counts[i] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(_CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) * rows / (time.perf_counter() - t0)


def _second_process(core: int) -> str:
    """What a second process asking for ``core`` is told (the first line)."""
    code = "import neuronmp; neuronmp.init()"
    env = dict(os.environ, NEURON_RT_VISIBLE_CORES=str(core), NEURONMP_RESERVE_TIMEOUT="0")
    env.pop("NEURON_RT_NUM_CORES", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    if res.returncode == 0:
        return "NOT refused (this is a bug)"
    last = res.stderr.strip().splitlines()[-1]
    return last.split(": ", 1)[-1] if last.startswith("neuronmp.") else last


def main() -> int:
    import torch

    import neuronmp
    from neuronmp.host import runtime

    rt = runtime.get_runtime()
    n = len(rt.cores)
    topo = rt.topology
    print(f"1. emulated host: {topo.name}, {topo.chips} chip(s) x {topo.cores_per_chip} "
          f"core(s); this process (pid {os.getpid()}) owns global core(s) "
          f"{list(rt.cores)} as nc:0-nc:{n - 1}")
    refusal = _second_process(rt.cores[-1])
    print(f"2. a second process asking for core {rt.cores[-1]}: {refusal}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 10)).eval()
    per_core = 32
    traced = neuronmp.trace(model, torch.rand(per_core, 512))
    parallel = neuronmp.DataParallel(traced)
    x = torch.rand(per_core * n, 512)
    with torch.no_grad():
        expected = model(x)
    got = parallel(x)
    ok = torch.allclose(got, expected, atol=1e-5)
    print(f"3. DataParallel over {n} worker process(es), batch {tuple(x.shape)}: output "
          f"{tuple(got.shape)} {'matches' if ok else 'DOES NOT match'} plain torch")

    timed = neuronmp.trace(model, torch.rand(per_core, 512), device_time=_COST_US)
    one = _throughput(lambda: timed(x[:per_core]), per_core)
    timed_dp = neuronmp.DataParallel(timed)
    every = _throughput(lambda: timed_dp(x), per_core * n)
    print(f"4. device-time cores ({_COST_US // 1000} ms per batch of {per_core} rows): one core "
          f"{one:,.0f} rows/s, DataParallel on {n} core(s) {every:,.0f} rows/s "
          f"({every / one:.2f}x; exact ceiling {n}x)")
    print("   why: each emulated core sleeps through its modelled device time, as a "
          "NeuronCore leaves the host CPU free, so cores add up as on a real host; "
          "CPU-bound compute would only share this machine's CPUs")
    neuronmp.shutdown()
    return 0 if ok and "NOT refused" not in refusal else 1


if __name__ == "__main__":
    sys.exit(main())
