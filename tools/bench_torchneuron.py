"""The emulated ``neuron`` device's overheads, as ratios measured in the same run.

  eager      one ATen op on small neuron tensors against the same op on CPU tensors
             (the device's cost: the dispatcher's PrivateUse1 fallback, CPU aliases of
             the same memory, the output adopted; target <= 3x)
  compile    one call of torch.compile(backend="neuron") of a small MLP against one
             call of the same MLP traced with neuronmp.trace, both on core 0 of this
             process (the same worker, the same request path; the compiled call adds
             the input/output copies to and from neuron tensors; target <= 2x),
             then where that call's time goes, in one more interleaved loop: the
             traced call, the backend's callable called directly with the graph's
             arguments, Dynamo's frame around a backend that returns its input at
             once, Dynamo's frame around a backend that is the traced call (the
             same wait for the core, none of our backend's work), and the compiled
             call, each in wall time, in the caller's CPU time outside the
             runtime's call, and with its Python calls counted
  import     whole-process timing of ``python -c "import torch"`` with torch's
             backend autoload on (our entry point runs and returns at once, the
             variable unset) against TORCH_DEVICE_BACKEND_AUTOLOAD=0 (it never runs);
             the difference is mostly torch's own scan of every installed package's
             entry points, so the entry point's own load and call is timed alone too

Runs in a child with NEURONMP_PROVIDE=torchneuron, a private runtime directory and an
emulated 1x2 host; intra-op threads are 1, and the two sides of a ratio are timed in
alternating loops, so the shared host's load moves both alike.  Each figure is the
median of --repeats timed loops.

    python tools/bench_torchneuron.py [--repeats 7] [--iters 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, statistics, sys, time, torch
import neuronmp
repeats, iters = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)

def per_call(fns, n, clock=time.perf_counter):
    # median microseconds per call of each of fns, their loops interleaved so that
    # the shared host's load drifts hit every side of a ratio alike
    for fn in fns:
        for _ in range(max(n // 10, 10)):
            fn()
    out = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, out):
            t = clock()
            for _ in range(n):
                fn()
            times.append((clock() - t) / n * 1e6)
    return [statistics.median(times) for times in out]

def python_calls(fn, n=20):
    # Python functions and C functions called from Python, per call of fn: a count
    # that the host's load does not move
    count = [0]
    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
    sys.setprofile(prof)
    for _ in range(n):
        fn()
    sys.setprofile(None)
    return count[0] / n

# the calling thread's CPU time outside the runtime's call (its send and its wait,
# whose spin is CPU time too and follows the worker's latency): what Dynamo and the
# backend cost the caller, which the host's load moves less than wall time
from neuronmp.pool import answer as _answer
from neuronmp.session import model as _model
in_runtime = [0.0]
def runtime_timed(f):
    def timed(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            in_runtime[0] += time.thread_time() - t
    return timed
def cpu_outside_runtime():
    return time.thread_time() - in_runtime[0]

rows = []
def eager(name, make, op, op_dev=None):
    cpu = make()
    dev = [t.to("neuron") for t in cpu]
    rows.append(["eager", name, *per_call([lambda: op(*cpu), lambda: (op_dev or op)(*dev)],
                                          iters)])

eager("add 4x4", lambda: (torch.randn(4, 4), torch.randn(4, 4)), torch.add)
eager("mul 64x64", lambda: (torch.randn(64, 64), torch.randn(64, 64)), torch.mul)
eager("relu 256", lambda: (torch.randn(256),), torch.relu)
eager("mm 64x64", lambda: (torch.randn(64, 64), torch.randn(64, 64)), torch.mm)
eager("sum 64x64", lambda: (torch.randn(64, 64),), torch.sum)
lin = torch.nn.Linear(64, 64)
eager("Linear 8x64 (module)", lambda: (torch.randn(8, 64),), lin,
      torch.nn.Linear(64, 64).to("neuron"))

torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
x = torch.randn(4, 32)
with torch.no_grad():
    traced = neuronmp.trace(mlp, x)
    neuronmp.session.model.get(traced.nmp_handle).place(0, 1)   # core 0, as neuron:0's graph
    compiled = torch.compile(mlp.to("neuron"), backend="neuron", fullgraph=True)
    xd = x.to("neuron")
    assert torch.allclose(compiled(xd).cpu(), traced(x), atol=1e-6)
    n = max(iters // 10, 50)
    rows.append(["compile", "MLP 4x32 (traced -> compiled)",
                 *per_call([lambda: traced(x), lambda: compiled(xd)], n)])

    # where a compiled call's time goes: the same MLP compiled again through a backend
    # that keeps the neuron backend's callable (called directly, with the arguments
    # Dynamo passes it), and once through a backend that returns its input at once
    # (Dynamo's frame with nothing inside)
    from neuronmp.torchneuron.backend import neuron_backend
    kept = []
    def keeping(gm, example_inputs):
        kept.append((neuron_backend(gm, example_inputs), list(example_inputs)))
        return kept[-1][0]
    def returning_input(gm, example_inputs):
        at = next(i for i, a in enumerate(example_inputs)
                  if not isinstance(a, torch.nn.Parameter))
        return lambda *args: (args[at],)
    def fresh():
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        m.load_state_dict(mlp.state_dict())
        return m.to("neuron")
    again = fresh()
    via_kept = torch.compile(again, backend=keeping, fullgraph=True)
    via_kept(xd)
    graph, graph_args = kept[0]
    own = {id(p) for p in again.parameters()}
    graph_args = [a if id(a) in own else xd for a in graph_args]
    assert len(own) == len(graph_args) - 1, "the graph's arguments: its weights and x"
    frame_only = torch.compile(fresh(), backend=returning_input, fullgraph=True)
    frame_only(xd)
    # and once through a backend whose callable is the traced call itself: Dynamo's
    # frame around the same wait for the core, none of the neuron backend's work
    around_traced = torch.compile(fresh(), backend=lambda gm, _: lambda *a: (traced(x),),
                                  fullgraph=True)
    around_traced(xd)
    fns = [lambda: traced(x), lambda: graph(*graph_args), lambda: frame_only(xd),
           lambda: around_traced(xd), lambda: via_kept(xd)]
    times = per_call(fns, n)
    runtime = [(cls, name, getattr(cls, name)) for cls, name in (
        (_model.Model, "submit"), (_answer.Pending, "result"), (_answer.Answer, "result"))]
    for cls, name, f in runtime:
        setattr(cls, name, runtime_timed(f))
    cpu = per_call(fns, n, clock=cpu_outside_runtime)
    for cls, name, f in runtime:   # the Python calls are counted without the timers
        setattr(cls, name, f)
    stages = [[name, us, cpu_us, python_calls(fn)] for name, us, cpu_us, fn in zip(
        ["traced call (the device call)", "the backend's callable, called directly",
         "Dynamo's frame around nothing", "Dynamo's frame around the traced call",
         "compiled call"], times, cpu, fns)]
print(json.dumps({"rows": rows, "stages": stages}))
"""


def child_rows(repeats: int, iters: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir="/dev/shm") as rt:
        env = dict(os.environ, NEURONMP_PROVIDE="torchneuron", NEURONMP_RUNTIME_DIR=rt,
                   NEURONMP_TOPOLOGY="1x2")
        env.pop("NEURON_RT_VISIBLE_CORES", None)
        env.pop("NEURON_RT_NUM_CORES", None)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(repeats), str(iters)],
                              env=env, capture_output=True, text=True, timeout=1800,
                              cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        sys.exit(f"benchmark child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_stages(stages: list) -> None:
    """Where a compiled call's time goes, from one interleaved loop: the parts and
    what is left between them, in wall time and in the caller's CPU time outside
    the runtime's call."""
    print("\nwhere a compiled call's time goes (same loop; CPU: the calling thread's "
          "outside the runtime's send and wait; Python calls counted with sys.setprofile)")
    for name, t, cpu, calls in stages:
        print(f"  {name:50} {t:8.1f} us {cpu:8.1f} us CPU {calls:6.0f} calls")
    (traced, traced_cpu), (direct, direct_cpu), (frame, frame_cpu), \
        (around, around_cpu), (compiled, compiled_cpu) = [(t, c) for _, t, c, _ in stages]
    print(f"  {'the backend beyond the device call (copies, checks)':50} "
          f"{direct - traced:8.1f} us {direct_cpu - traced_cpu:8.1f} us CPU")
    print(f"  {'Dynamo around the backend (compiled - direct)':50} "
          f"{compiled - direct:8.1f} us {compiled_cpu - direct_cpu:8.1f} us CPU")
    print(f"  {'Dynamo around the traced call (that - traced)':50} "
          f"{around - traced:8.1f} us {around_cpu - traced_cpu:8.1f} us CPU")
    print(f"  {'Dynamo around nothing':50} {frame:8.1f} us {frame_cpu:8.1f} us CPU")


def import_rows(repeats: int) -> list:
    env = {k: v for k, v in os.environ.items() if k != "NEURONMP_PROVIDE"}
    times = {"on": [], "off": []}
    for _ in range(repeats):   # interleaved: load drifts hit both alike
        for mode in ("off", "on"):
            e = dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if mode == "on" else "0")
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], env=e, check=True,
                           timeout=300, cwd=tempfile.gettempdir())
            times[mode].append((time.perf_counter() - t) * 1e6)
    return [["import", "python -c 'import torch' (autoload off -> on)",
             statistics.median(times["off"]), statistics.median(times["on"])]]


ENTRY = r"""
import time
from importlib.metadata import entry_points
ep = [e for e in entry_points(group="torch.backends") if e.name == "neuronmp_torchneuron"][0]
t = time.perf_counter()
ep.load()()
print((time.perf_counter() - t) * 1e6)
"""


def entry_point_us(repeats: int) -> float:
    """Our share of ``import torch`` with the variable unset: loading the entry point
    (the standard-library hook module, cold, in a fresh process) and calling it."""
    env = {k: v for k, v in os.environ.items() if k != "NEURONMP_PROVIDE"}
    runs = [float(subprocess.run([sys.executable, "-c", ENTRY], env=env, check=True,
                                 capture_output=True, text=True, timeout=120,
                                 cwd=tempfile.gettempdir()).stdout) for _ in range(repeats)]
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    child = child_rows(args.repeats, args.iters)
    rows = child["rows"] + import_rows(args.repeats)
    targets = {"eager": 3.0, "compile": 2.0, "import": None}
    print(f"{'kind':8} {'case':48} {'baseline us':>12} {'neuron us':>10} {'ratio':>6} target")
    for kind, name, base, dev in rows:
        target = targets[kind]
        ratio = dev / base
        verdict = "" if target is None else (f"<= {target:g}x " +
                                              ("met" if ratio <= target else "MISSED"))
        print(f"{kind:8} {name:48} {base:12.1f} {dev:10.1f} {ratio:6.2f} {verdict}")
    print_stages(child["stages"])
    print(f"the neuronmp entry point's own cost at import torch (variable unset, cold): "
          f"{entry_point_us(args.repeats):.0f} us")


if __name__ == "__main__":
    main()
