"""Benchmark: what a core's worker pays to run a traced model, against plain torch.

bench_dp's MLP (512-1024-1024-10), traced with the batch buckets neuronmp-serve uses
(1,2,4,8,16,24,32 unless --buckets says otherwise).  Two measurements, both against
the same module called eagerly under ``torch.inference_mode`` with one torch thread:

  in process   the compiled graph a worker loads (the bytes ``neuronmp.trace`` saves,
               loaded with ``torch.jit.load``, called as the worker calls it: its
               ``forward(1, x)`` under ``inference_mode``), in one process pinned to
               one CPU; CPU time of the calling thread.  Variants of how TorchScript
               runs it (--variants): the profiling executor off, optimized execution
               off, the loaded graph frozen (``torch.jit.freeze``), no inference_mode.
               Always: the graph traced with ``compiler_args="--optlevel 3"`` (each
               Linear's weight stored column-major, see neuronmp.trace).
  on a core    the traced model called on its core (one worker, pinned, its idle
               spin off: NEURONMP_WORKER_SPIN_US=0); CPU time of the worker process
               per call (whole-process timing from the kernel's per-thread schedstat:
               the forward plus the request's receive, the answer's send and the
               futex waits), and of the caller.

For each batch size, CPU per row carried (microseconds; a batch between buckets runs
padded to the next, as the server runs it) and the traced/eager ratio.  A
ratio near 1.0 says the trace itself costs what torch does and the rest of a
worker's per-request CPU is the transport's.

    python tools/bench_serve_forward.py [--rows 1,2,4,8,16,20,24,32] [--calls 300]
                                        [--cpu 0] [--variants] [--no-core]
                                        [--compiler-args "--optlevel 3"]
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

FEATURES = 512
TRACE_AT = 32


def _thread_us(runs: Dict[str, Tuple[Callable[[object], object], object]], calls: int,
               rounds: int = 5) -> Dict[str, float]:
    """{name: CPU microseconds per call of this thread}, the least of ``rounds`` runs
    of ``calls`` calls of each ``fn(x)``, the variants alternating round by round (a
    shared host's memory bandwidth drifts; all the variants see the same drift)."""
    for fn, x in runs.values():
        for _ in range(20):
            fn(x)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, (fn, x) in runs.items():
            t0 = time.thread_time_ns()
            for _ in range(calls):
                fn(x)
            best[name] = min(best[name], (time.thread_time_ns() - t0) / calls / 1e3)
    return best


def _loaded_graph(net, buckets: List[int], layout: bool = False):
    """The compiled graph a worker loads, loaded as the worker loads it; ``layout``:
    traced as ``compiler_args="--optlevel 3"`` traces it (Linear weights column-major)."""
    import torch

    from neuronmp import tracing
    from neuronmp.host import _torchscript
    from neuronmp.session import pytree

    example = torch.rand(TRACE_AT, FEATURES)
    with torch.no_grad():
        spec = pytree.spec_of(net(example))
    graph, _ = tracing._compile(net, spec, (example,), None, buckets, layout)
    with _torchscript.quiet():
        runner = torch.jit.load(io.BytesIO(graph), map_location="cpu")
    runner.eval()
    return runner


def in_process(rows: List[int], buckets: List[int], calls: int, cpu: int,
               variants: bool) -> Dict[str, Dict[int, float]]:
    """{variant: {rows: CPU us per row}}, ``eager`` included; pinned to ``cpu``."""
    import torch
    from bench_dp import mlp

    from neuronmp.host import _torchscript

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp().eval()
    runner = _loaded_graph(net, buckets)
    laid_out = _loaded_graph(net, buckets, layout=True)
    runs: Dict[str, Callable] = {
        "eager": lambda x: net(x),
        "traced (as a worker runs it)": lambda x: runner.forward(1, x),
        "traced with --optlevel 3": lambda x: laid_out.forward(1, x),
    }
    if variants:
        with _torchscript.quiet():
            frozen = torch.jit.freeze(_loaded_graph(net, buckets), preserved_attrs=["run"])

        def no_profiling(x):
            old = torch._C._jit_set_profiling_executor(False)
            try:
                return runner.forward(1, x)
            finally:
                torch._C._jit_set_profiling_executor(old)

        def unoptimized(x):
            with torch.jit.optimized_execution(False):
                return runner.forward(1, x)

        runs["traced, frozen"] = lambda x: frozen.forward(1, x)
        runs["traced, profiling executor off"] = no_profiling
        runs["traced, optimized execution off"] = unoptimized
    out: Dict[str, Dict[int, float]] = {name: {} for name in runs}
    if variants:
        out["traced, no inference_mode"] = {}
    for r in rows:
        x = torch.rand(r, FEATURES)
        padded = _padded(x, buckets)   # as the server pads a batch to its bucket
        with torch.inference_mode():
            cpu = _thread_us({name: (fn, x if name == "eager" else padded)
                              for name, fn in runs.items()}, calls)
        if variants:   # outside inference_mode: the runner's own no_grad only
            cpu.update(_thread_us({"traced, no inference_mode": (
                lambda v: runner.forward(1, v), padded)}, calls))
        for name, us in cpu.items():
            out[name][r] = us / r
    return out


def _padded(x, buckets: List[int]):
    """``x`` padded with zero rows to the smallest bucket that holds it."""
    import torch

    size = min(b for b in buckets if b >= x.shape[0])
    return torch.cat([x, x.new_zeros(size - x.shape[0], x.shape[1])]) if size > x.shape[0] else x


_ON_CORE = """
import json, os, sys, time, psutil, torch, neuronmp
sys.path.insert(0, {tools!r})
from bench_dp import mlp
torch.manual_seed(0)
torch.set_num_threads(1)
net = mlp().eval()
traced = neuronmp.trace(net, torch.rand({trace_at}, {features}), batch_buckets={buckets!r},
                        compiler_args={compiler_args!r})
me = psutil.Process()

def cpu_s(pid):   # nanosecond CPU time of every thread (the kernel's schedstat)
    total = 0
    for task in os.listdir(f"/proc/{{pid}}/task"):
        with open(f"/proc/{{pid}}/task/{{task}}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9

def workers():
    out = {{}}
    for p in me.children(recursive=True):
        try:
            out[p.pid] = cpu_s(p.pid)
        except (OSError, psutil.NoSuchProcess):
            pass
    return out

res = {{}}
for r in {rows!r}:
    x = torch.rand(r, {features})
    for _ in range(30):
        traced(x)
    w0, c0 = workers(), cpu_s(os.getpid())
    for _ in range({calls}):
        traced(x)
    w1, c1 = workers(), cpu_s(os.getpid())
    res[r] = [sum(w1[p] - w0.get(p, 0.0) for p in w1) / {calls} * 1e6,
              (c1 - c0) / {calls} * 1e6]
print(json.dumps(res))
neuronmp.shutdown()
"""


def on_core(rows: List[int], buckets: List[int], calls: int,
            compiler_args: str = "") -> Dict[int, List[float]]:
    """{rows: [worker CPU us per call, caller CPU us per call]} from a fresh process."""
    import json

    rundir = tempfile.mkdtemp(prefix="nmp-bench-forward-", dir="/dev/shm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}
    env.update(NEURONMP_RUNTIME_DIR=rundir, NEURONMP_WORKER_SPIN_US="0")
    try:
        p = subprocess.run([sys.executable, "-c", _ON_CORE.format(
            tools=TOOLS, trace_at=TRACE_AT, features=FEATURES, buckets=buckets,
            rows=rows, calls=calls, compiler_args=compiler_args or None)], env=env,
            capture_output=True, text=True,
            timeout=600)
    finally:
        subprocess.run(["rm", "-rf", rundir], check=False)
    if p.returncode:
        raise RuntimeError(f"the on-core run failed:\n{p.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,20,24,32")
    p.add_argument("--buckets", default="1,2,4,8,16,24,32")
    p.add_argument("--calls", type=int, default=300, help="calls per measured run")
    p.add_argument("--cpu", type=int, default=0, help="the CPU the in-process run is pinned to")
    p.add_argument("--variants", action="store_true",
                   help="also time the TorchScript variants named in the module docstring")
    p.add_argument("--no-core", action="store_true", help="skip the on-core measurement")
    p.add_argument("--compiler-args", default="",
                   help="the on-core model's trace compiler_args, e.g. \"--optlevel 3\"")
    args = p.parse_args()
    rows, buckets = _ints(args.rows), _ints(args.buckets)
    load = os.getloadavg()[0]
    cores = {} if args.no_core else on_core(rows, buckets, args.calls, args.compiler_args)
    local = in_process(rows, buckets, args.calls, args.cpu, args.variants)
    eager = local["eager"]
    print(f"bench_dp's MLP traced at {TRACE_AT} with buckets {args.buckets}; CPU us per row "
          f"(in process: pinned to CPU {args.cpu}, least of 5 alternated runs of "
          f"{args.calls} calls); "
          f"load average {load:.1f}\n")
    names = [n for n in local if n != "eager"]
    head = ["rows", "eager us/row"] + [f"{n} us/row (x eager)" for n in names]
    if cores:
        what = f" ({args.compiler_args})" if args.compiler_args else ""
        head += [f"on a core{what}: worker us/row (x eager)", "caller us/row"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [str(r), f"{eager[r]:.1f}"]
        cells += [f"{local[n][r]:.1f} ({local[n][r] / eager[r]:.2f}x)" for n in names]
        if cores:
            worker, caller = cores[r]
            cells += [f"{worker / r:.1f} ({worker / r / eager[r]:.2f}x)", f"{caller / r:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
