"""The ``neuron`` process group against gloo, same ranks, same run.

  barrier                 the synchronisation alone: the floor of a small collective
  all_reduce              2 ranks, 64 KiB .. 16 MiB of fp32, then 4 ranks (SUM)
  all_gather_into_tensor  16 MiB per rank's output, 2 ranks
  reduce_scatter_tensor   16 MiB of input per rank, 2 ranks
  memcpy                  one tensor copy of the same size in every rank at once: the
                          memory-bandwidth floor the collectives are measured against
  skewed all_reduce       2 and 4 ranks, 64 KiB and 16 MiB, each call after a gloo
                          barrier of another group, so the ranks arrive apart as they do
                          after a backward pass; the call alone is timed, and the figure
                          is the mean over the ranks (the first to arrive waits, the last
                          does not)

With ``--floors`` it first measures, in one process and in two at once (no torchrun):
a 16 MiB copy on one CPU and on two CPUs at once, ``torch.add(a, b, out=c)`` at 16 MiB
and 64 KiB, a kernel read of another process's memory (process_vm_readv, the way an
all_gather reads its peers), and a futex ping-pong between two processes (the
transport's wait with no spin and with the configured spin): the ceilings a
shared-memory collective on this host cannot pass.

Each job is one torchrun of N ranks (NEURONMP_PROVIDE=torchneuron, a private runtime
directory, an emulated 1x4 host) whose ranks hold both groups: the neuron group on
neuron tensors and a gloo group on CPU tensors.  The two alternate per repeat, so the
shared host's load moves both sides of a ratio alike; each figure is rank 0's median
over --repeats of a timed loop (whole loop / its iterations).  Intra-op threads are 1.

With ``--phases CALLS`` it only runs one 2-rank job whose ranks stamp every phase of
CALLS 64 KiB all_reduces (torch and the group's method, copy in, publish, the wait and
how late the peer was, reduce, return; thread CPU time and the CPU each rank ran on)
into a preallocated array, and prints where a call's time goes; ``--pin`` puts each
rank on a CPU of its own (in the other jobs too: rank modulo the CPUs, so the
scheduler cannot put two ranks of 2 on one CPU).  ``--small`` runs only the 2-rank
barrier and 64 KiB rows; ``--skewed`` only the skewed all_reduce rows.

With ``--against REF`` every job runs twice per round, alternating (which side goes
first too): once on this tree and once on git REF's ``neuronmp`` (unpacked into a
temporary directory, with this tree's compiled extensions), so a change is measured
before/after in one run; ``--against-env VAR=VALUE`` (repeatable) gives the other side
an environment variable too, and alone runs this tree against itself with it (a knob's
A/B, such as NEURONMP_COLLECTIVE_SPIN_US).  The skewed rows also print each rank's
wait counters (waits a spin caught, waits that slept, calls it reduced as the last,
pieces of mapped all_reduces it reduced).

    python tools/bench_collectives.py [--repeats 5] [--rounds 1] [--against REF]
                                      [--against-env VAR=VALUE] [--small | --skewed]
                                      [--pin] [--floors] [--plot PATH]
    python tools/bench_collectives.py --phases CALLS [--pin]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

RANK = r"""
import json, os, statistics, sys, time, torch, torch.distributed as dist
torch.set_num_threads(1)
if os.environ.get("BENCH_COLLECTIVES_PIN"):   # --pin: each rank on a CPU of its own
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
dist.init_process_group("neuron")
gloo = dist.new_group(backend="gloo")
other = dist.new_group(backend="gloo")   # the barrier before each skewed call
rank, world = dist.get_rank(), dist.get_world_size()
repeats, spec = int(sys.argv[1]), json.loads(sys.argv[2])
dev = torch.device("neuron")

def loop(fn, iters):
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters

engine = getattr(dist.group.WORLD, "_shm", None)
COUNTS = ("waits_caught", "waits_slept", "reduced_last", "pieces_reduced")
waits = {}   # a skewed row's neuron calls: the engine's counters, summed over repeats

def counts():
    return [getattr(engine, k, 0) for k in COUNTS] if engine is not None else [0] * 4

def skewed(fn, iters, key=None):
    # each call after a barrier of another group: the ranks leave it apart, as after
    # a backward pass; only the call is timed
    dist.barrier(group=gloo)
    total, before = 0.0, counts()
    for _ in range(iters):
        dist.barrier(group=other)
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    if key is not None:
        got = waits.setdefault(key, [0, 0, 0, 0, 0])
        got[:4] = [g + a - b for g, a, b in zip(got, counts(), before)]
        got[4] += iters
    return total / iters

def case(op, nbytes):
    n = nbytes // 4
    op = op.replace("skewed ", "")
    if op == "barrier":
        return (lambda: dist.barrier(), lambda: dist.barrier(group=gloo))
    if op == "all_reduce":
        a, b = torch.ones(n, device=dev), torch.ones(n)
        return (lambda: dist.all_reduce(a), lambda: dist.all_reduce(b, group=gloo))
    if op == "all_gather_into_tensor":
        k = n // world
        oa, ia = torch.empty(n, device=dev), torch.ones(k, device=dev)
        ob, ib = torch.empty(n), torch.ones(k)
        return (lambda: dist.all_gather_into_tensor(oa, ia),
                lambda: dist.all_gather_into_tensor(ob, ib, group=gloo))
    k = n // world
    oa, ia = torch.empty(k, device=dev), torch.ones(n, device=dev)
    ob, ib = torch.empty(k), torch.ones(n)
    return (lambda: dist.reduce_scatter_tensor(oa, ia),
            lambda: dist.reduce_scatter_tensor(ob, ib, group=gloo))

rows = []
for op, nbytes in spec:
    neuron, g = case(op, nbytes)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    iters = max(3, min(200, (32 << 20) // max(nbytes, 1)))
    run = skewed if op.startswith("skewed ") else loop
    run(neuron, 2); run(g, 2)
    tn, tg, tc = [], [], []
    for _ in range(repeats):
        tn.append(run(neuron, iters, nbytes) if run is skewed else run(neuron, iters))
        tg.append(run(g, iters))
        tc.append(loop(lambda: dst.copy_(src), iters))   # every rank copying at once
    rows.append([op, nbytes, statistics.median(tn), statistics.median(tg),
                 statistics.median(tc)])
every = [None] * world
dist.all_gather_object(every, rows, group=gloo)
counted = [None] * world
dist.all_gather_object(counted, waits, group=gloo)
for i, row in enumerate(rows):   # a skewed row: the mean over the ranks
    if row[0].startswith("skewed "):
        row[2:] = [statistics.mean(r[i][k] for r in every) for k in (2, 3, 4)]
if rank == 0:
    import neuronmp
    print("TREE " + neuronmp.__file__, flush=True)
    print("ROWS " + json.dumps(rows), flush=True)
    print("WAITS " + json.dumps(counted), flush=True)
dist.barrier(group=gloo)   # no rank tears gloo down while a peer still uses it
dist.destroy_process_group()
"""

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
SKEWED = [["skewed all_reduce", 64 << 10], ["skewed all_reduce", 16 << 20]]
JOBS = [
    (2, [["barrier", 0]] + [["all_reduce", s] for s in SIZES]
     + [["all_gather_into_tensor", 16 << 20], ["reduce_scatter_tensor", 16 << 20]]
     + SKEWED),
    (4, [["barrier", 0]] + [["all_reduce", s] for s in SIZES] + SKEWED),
]


def _job(nproc: int, spec, repeats: int, script: str, rundir: str,
         tree: Optional[str] = None, pin: bool = False, extra: Optional[dict] = None,
         waits: Optional[dict] = None):
    """The rows of one torchrun job; the engine's wait counters of its skewed rows
    are added into ``waits`` (by (ranks, bytes): per rank caught, slept, reduced as
    the last, pieces reduced, calls)."""
    env = dict(os.environ, NEURONMP_PROVIDE="torchneuron", NEURONMP_RUNTIME_DIR=rundir,
               NEURONMP_TOPOLOGY="1x4", OMP_NUM_THREADS="1", **(extra or {}))
    if pin:
        env["BENCH_COLLECTIVES_PIN"] = "1"
    if tree is not None:   # the other tree's package first on the ranks' path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", script, str(repeats), json.dumps(spec)]
    # run from the run directory: no checkout in the working directory shadows ``tree``
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800,
                         cwd=rundir)
    if out.returncode:
        raise SystemExit(out.stderr[-4000:])
    used = next(x for x in out.stdout.splitlines() if x.startswith("TREE "))[5:]
    if tree is not None and not used.startswith(tree + os.sep):
        raise SystemExit(f"the ranks imported {used}, not the package under {tree}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("ROWS "))
    counted = next(x for x in out.stdout.splitlines() if x.startswith("WAITS "))
    for rank, per in enumerate(json.loads(counted[6:])):
        for nbytes, got in per.items():
            into = waits.setdefault((nproc, int(nbytes)), {}) if waits is not None else {}
            into[rank] = [a + b for a, b in zip(into.get(rank, [0] * 5), got)]
    return [[nproc, *row] for row in json.loads(line[5:])]


def _size(n: int) -> str:
    if n == 0:
        return "-"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _unpack(ref: str, into: str) -> str:
    """git ``ref``'s neuronmp package under ``into``, with this tree's compiled
    extensions (they are build products, not in git); the directory to put on the path."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                         text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", top, "archive", ref, "neuronmp"],
                             capture_output=True, check=True).stdout
    os.makedirs(into, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    pkg = os.path.join(top, "neuronmp")
    for base, _, files in os.walk(pkg):
        for name in files:
            if name.endswith(".so"):
                dest = os.path.join(into, "neuronmp", os.path.relpath(base, pkg), name)
                if os.path.isdir(os.path.dirname(dest)) and not os.path.exists(dest):
                    shutil.copy2(os.path.join(base, name), dest)
    return into


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every job this many times (medians of the rounds)")
    ap.add_argument("--against", metavar="REF",
                    help="also run git REF's neuronmp, alternating with this tree")
    ap.add_argument("--against-env", metavar="VAR=VALUE", action="append", default=[],
                    help="the other side (this tree, or REF's) runs with this environment "
                         "variable too (repeatable): A/B of a knob in one run")
    ap.add_argument("--plot", help="write a matplotlib figure of all_reduce here")
    ap.add_argument("--small", action="store_true",
                    help="only the 2-rank barrier and 64 KiB all_reduce (quick A/B runs)")
    ap.add_argument("--skewed", action="store_true",
                    help="only the skewed all_reduce rows (2 and 4 ranks)")
    ap.add_argument("--phases", type=int, metavar="CALLS",
                    help="only time the phases of CALLS 64 KiB all_reduces on 2 ranks")
    ap.add_argument("--pin", action="store_true",
                    help="each rank pinned to a CPU of its own (rank %% CPUs)")
    ap.add_argument("--floors", action="store_true",
                    help="first measure the host's copy, add and wake-up floors")
    args = ap.parse_args()
    if args.phases:
        _phases(args.phases, args.pin)
        return
    if args.floors:
        _floors()
    mine, theirs, loads = {}, {}, [_load()]
    with tempfile.TemporaryDirectory(prefix="bench-coll-", dir="/dev/shm") as rundir:
        script = os.path.join(rundir, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        tree = None
        if args.against:
            tree = _unpack(args.against, os.path.join(rundir, "against"))
        jobs = [(2, [["barrier", 0], ["all_reduce", 64 << 10]])] if args.small else JOBS
        if args.skewed:
            jobs = [(2, SKEWED), (4, SKEWED)]
        extra = dict(kv.split("=", 1) for kv in args.against_env)
        other = args.against or "this tree"
        if extra:
            other += " with " + " ".join(args.against_env)
        sides = [(mine, None, None, {})]
        if tree is not None or extra:
            sides.append((theirs, tree, extra, {}))
        for n in range(args.rounds):
            for nproc, spec in jobs:
                # each round the other side first in turn: a load that grows or fades
                # during a round weighs on both alike
                for into, where, env, waits in sides[::-1] if n % 2 else sides:
                    for row in _job(nproc, spec, args.repeats, script, rundir, where,
                                    args.pin, env, waits):
                        into.setdefault(tuple(row[:3]), []).append(row[3:])
            loads.append(_load())
    rows = [[*key, *(statistics.median(v[i] for v in vals) for i in range(3))]
            for key, vals in mine.items()]
    _table(rows, theirs, other if len(sides) > 1 else None)
    for (_, _, _, waits), name in zip(sides, ["this tree", other]):
        _waits_table(waits, name)
    print(f"load average (1 min) at the start and after each round: {' '.join(loads)}")
    if args.plot:
        _plot(rows, args.plot)


def _best(fn, iters: int) -> float:
    """Median seconds per call over 5 timed loops of ``iters`` calls (after one)."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def _copy(nbytes: int, iters: int) -> float:
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return _best(lambda: dst.copy_(src), iters)


def _add(nbytes: int, iters: int) -> float:
    import torch

    torch.set_num_threads(1)
    a, b, c = torch.ones(nbytes // 4), torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return _best(lambda: torch.add(a, b, out=c), iters)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_read(nbytes: int, iters: int) -> float:
    """A kernel read of nbytes from a process's memory (this one's: the same path)."""
    import torch

    readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    local, remote = _Iovec(dst.data_ptr(), nbytes), _Iovec(src.data_ptr(), nbytes)
    pid = os.getpid()
    return _best(lambda: readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0),
                 iters)


def _in_two(target, args, per_process=((), ()), pick=max) -> float:
    """Run ``target(q, *args, *per_process[i])`` in two processes started together;
    ``pick`` of their two results (by default the slower's)."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(q, *args, *extra)) for extra in per_process]
    for p in procs:
        p.start()
    out = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return pick(out)


def _copy_at_once(q, bar, nbytes, iters):
    import torch

    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    bar.wait(timeout=60)
    q.put(_best(lambda: dst.copy_(src), iters))


def _ping(q, mm, me: int, iters: int, spin: float, pause: float):
    """One side of a ping-pong on two counters: rank 0 publishes odd values, 1 even."""
    from neuronmp.shm import _waits as w

    peer, v = 1 - me, 0
    mine, theirs = 64 * (me + 1), 64 * (peer + 1)
    flag_for_me, flag_for_peer = mine + 32, theirs + 32
    t0 = time.perf_counter()
    for i in range(iters):
        want = 2 * i + 2 if me == 0 else 2 * i + 1
        if me == 0:
            w.publish(mm, mine, 2 * i + 1, flag_for_peer)
        while v < want:
            v = w.wait(mm, theirs, v, flag_for_me, 0, spin, 1.0, pause)
        if me == 1:
            w.publish(mm, mine, 2 * i + 2, flag_for_peer)
    q.put((time.perf_counter() - t0) / iters)


def _pingpong(spin: float, pause: float, iters: int = 2000) -> float:
    mm = mmap.mmap(-1, 4096)
    return _in_two(_ping, (mm,), per_process=((0, iters, spin, pause), (1, iters, spin, pause)),
                   pick=min)


def _floors() -> None:
    from neuronmp.host import settings

    big, small = 16 << 20, 64 << 10
    print(f"floors (load average {_load()}): one intra-op thread, medians of 5 loops")
    c1, a1, v1 = _copy(big, 10), _add(big, 10), _vm_read(big, 10)
    bar = multiprocessing.get_context("fork").Barrier(2)
    c2 = _in_two(_copy_at_once, (bar, big, 10))
    gb = 1e9
    print(f"  copy 16 MiB, one CPU          {c1 * 1e6:9.1f} us  {2 * big / c1 / gb:5.1f} GB/s "
          "moved (read + write)")
    print(f"  copy 16 MiB, two CPUs at once {c2 * 1e6:9.1f} us  {4 * big / c2 / gb:5.1f} GB/s "
          "moved by both")
    print(f"  add 16 MiB (out=c)            {a1 * 1e6:9.1f} us  {3 * big / a1 / gb:5.1f} GB/s "
          "moved (2 reads + write)")
    a2 = _add(small, 2000)
    print(f"  add 64 KiB (out=c)            {a2 * 1e6:9.1f} us")
    print(f"  process_vm_readv 16 MiB       {v1 * 1e6:9.1f} us  ({v1 / c1:.2f}x the copy)")
    spin, pause = settings.get("ipc_spin"), settings.get("ipc_pause")
    for s, p in ((0.0, 0.0), (spin, pause)):
        rt = _pingpong(s, p)
        print(f"  futex ping-pong, spin {s * 1e6:3.0f} us  {rt * 1e6:9.1f} us a round trip")
    print("  bytes each rank moves (S = the tensor's bytes):")
    print("    all_reduce 2 ranks: through the segment copy in 2S + reduce 3S = 5S; on "
          "shareable tensors (mapped) each element of both tensors read once and written "
          "once, by the rank that claimed its piece: 2S per rank (4S in all)")
    print("    all_gather_into_tensor 2 ranks (output S): copy in S + own part S + copy out S"
          " = 3S through the segment; 2S reading the peer in place")
    print("    reduce_scatter_tensor 2 ranks (input S): copy in S + reduce 1.5S = 2.5S "
          "through the segment; mapped: reduce my half from both 1.5S")


# --phases: one 2-rank job stamping each phase of a 64 KiB all_reduce (the engine's
# one-round path, instrumented here as shm.ShmGroup._all_reduce_round runs it)
COLS = ["enter", "engine", "copied", "arrived", "seen", "reduced", "returned",
        "cpu_enter", "cpu_returned", "cpu_arrived", "cpu_seen", "waited", "on_cpu_seen",
        "on_cpu_enter"]
PHASES = r"""
import ctypes, os, sys, time, numpy as np, torch, torch.distributed as dist
from neuronmp.torchneuron.collectives import shm
torch.set_num_threads(1)
dist.init_process_group("neuron")
rank, iters, out = dist.get_rank(), int(sys.argv[1]), sys.argv[2]
if sys.argv[3] == "pin":   # each rank on a CPU of its own (others' jobs may share it)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})
g = dist.group.WORLD._shm
getcpu = ctypes.CDLL(None).sched_getcpu
ns, cpu_ns = time.perf_counter_ns, time.thread_time_ns
T = np.zeros((iters, len(COLS)), dtype=np.int64)
row = T[0]

def one_round(self, t, nbytes, reduce, op, root):
    row[1] = ns()
    mine = self._slot(self.rank, nbytes, t.dtype)
    mine.copy_(t)
    row[2] = ns()
    gen, last = self._arrive(hold=True)   # the call announced, the ticket drawn
    row[3], row[9] = ns(), cpu_ns()
    if not last:
        row[11] = 1
        self._await(gen, op)
    self._compare(gen, op)
    row[4], row[10], row[12] = ns(), cpu_ns(), getcpu()
    if last:   # the whole reduction, the others' result published before my copy
        parts = [self._slot(r, nbytes, t.dtype) for r in range(self.world)]
        parts[self.rank] = t
        shm._reduce_into(mine, parts, reduce)
        self._complete(gen)
        t.copy_(mine)
    else:      # the last rank's result copied out
        t.copy_(self._slot(shm._load(self._mm, self._who), nbytes, t.dtype))
    row[5] = ns()
    self._round += 1

g._all_reduce_round = one_round.__get__(g)
a = torch.ones(16384, device="neuron")
for _ in range(50):
    dist.all_reduce(a)
for i in range(iters):
    row = T[i]
    row[0], row[7], row[13] = ns(), cpu_ns(), getcpu()
    dist.all_reduce(a)
    row[6], row[8] = ns(), cpu_ns()
np.save(f"{out}{rank}.npy", T)
dist.destroy_process_group()
"""


def _phases(iters: int, pin: bool) -> None:
    """Where a 64 KiB all_reduce's time goes on 2 ranks: per call and rank, stamps
    (perf_counter_ns is CLOCK_MONOTONIC: comparable across the ranks) and thread CPU
    time into a preallocated array, saved after the loop."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="bench-phases-", dir="/dev/shm") as rundir:
        script = os.path.join(rundir, "phases.py")
        with open(script, "w") as f:
            f.write(f"COLS = {COLS!r}\n" + PHASES)
        env = dict(os.environ, NEURONMP_PROVIDE="torchneuron", NEURONMP_RUNTIME_DIR=rundir,
                   NEURONMP_TOPOLOGY="1x4", OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", script, str(iters), os.path.join(rundir, "rank"),
                "pin" if pin else "free"]
        load = _load()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                              cwd=rundir)
        if done.returncode:
            raise SystemExit(done.stderr[-4000:])
        ranks = [np.load(os.path.join(rundir, f"rank{r}.npy")) for r in (0, 1)]
    _print_phases(ranks, load, _load(), pin)


def _print_phases(ranks, load0: str, load1: str, pin: bool) -> None:
    import numpy as np

    c = {name: i for i, name in enumerate(COLS)}
    print(f"phases of a 64 KiB all_reduce, 2 ranks{' pinned to a CPU each' if pin else ''}, "
          f"{len(ranks[0])} calls (load average {load0} .. {load1}); us per call, mean "
          "(median)")
    for me in (0, 1):
        t, p = ranks[me], ranks[1 - me]
        col = {k: t[:, i] for k, i in c.items()}
        gap = np.diff(col["enter"])   # call to call, the loop's own time included

        def show(label, dt, me=me):
            dt = dt / 1e3
            print(f"  rank {me}  {label:<44} {dt.mean():8.1f} ({np.median(dt):7.1f})")

        show("whole call (enter to enter)", gap)
        show("  torch + group method, to the engine", col["engine"] - col["enter"])
        show("  copy in", col["copied"] - col["engine"])
        show("  publish my arrival, draw my ticket", col["arrived"] - col["copied"])
        show("  wait for the last rank's result", col["seen"] - col["arrived"])
        show("    of it: this rank's CPU time", col["cpu_seen"] - col["cpu_arrived"])
        late = np.maximum(0, p[:, c["arrived"]] - col["arrived"])
        show("    of it: the peer arrived after me by", late)
        show("    of it: seen after the peer arrived", col["seen"] - np.maximum(
            col["arrived"], p[:, c["arrived"]]))
        show("  reduce (the last rank) or copy out (the other)", col["reduced"] - col["seen"])
        show("  engine to return (Work, counting)", col["returned"] - col["reduced"])
        show("  loop to the next call", col["enter"][1:] - col["returned"][:-1])
        wall = col["returned"] - col["enter"]
        oncpu = col["cpu_returned"] - col["cpu_enter"]
        show("  call off this rank's CPU (wall - CPU time)", wall - oncpu)
        waited = col["waited"].mean() * 100
        absent = (p[:, c["enter"]] > col["arrived"]).mean() * 100
        same = (col["on_cpu_enter"] == p[:, c["on_cpu_enter"]]).mean() * 100
        print(f"  rank {me}  found the peer not yet arrived {waited:.0f}% of calls; "
              f"the peer had not even entered the call {absent:.0f}%; both ranks on one "
              f"CPU at entry {same:.0f}%")


def _waits_table(waits, name: str) -> None:
    """The skewed calls' waits by rank: how many a spin caught, how many slept, how
    many calls the rank reduced as the last to arrive (one-round all_reduces), how
    many pieces of mapped all_reduces it reduced (each piece is one rank's)."""
    if not waits:
        return
    print(f"skewed all_reduce waits, {name} (per rank: caught by the spin / slept / "
          "reduced as the last / pieces reduced; of calls)")
    for (nproc, nbytes), per in sorted(waits.items()):
        cells = "  ".join(f"{c}/{s}/{last}/{p}" for c, s, last, p, _ in
                          (per[r] for r in sorted(per)))
        print(f"  {nproc} ranks {_size(nbytes):>7}: {cells}  of {per[0][4]}")


def _table(rows, theirs, ref: Optional[str]) -> None:
    extra = f" {'B us':>13} {'B/A':>8}" if ref else ""
    if ref:
        print(f"A: this tree; B: {ref} (B/A: B's time over A's, above 1 when A is faster)")
    print(f"{'ranks':>5} {'collective':<24} {'size':>7} {'neuron us':>10} {'gloo us':>10} "
          f"{'gloo/neuron':>11} {'memcpy us':>10} {'neuron/memcpy':>13}" + extra)
    for nproc, op, nbytes, tn, tg, tc in rows:
        line = (f"{nproc:>5} {op:<24} {_size(nbytes):>7} {tn * 1e6:>10.1f} {tg * 1e6:>10.1f} "
                f"{tg / tn:>10.1f}x {tc * 1e6:>10.1f} {tn / max(tc, 1e-9):>12.1f}x")
        if ref:
            old = statistics.median(v[0] for v in theirs[(nproc, op, nbytes)])
            line += f" {old * 1e6:>13.1f} {old / tn:>7.2f}x"
        print(line)
    print("memcpy: one copy of the size in every rank at once, the same ranks and run: an "
          "all_reduce of shareable tensors (1 MiB and more) moves about 2S per rank on 2 ranks "
          "(a memcpy moves 2S); through the segment 5S")


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for nproc in sorted({r[0] for r in rows}):
        sel = [r for r in rows if r[0] == nproc and r[1] == "all_reduce"]
        x = [r[2] for r in sel]
        ax.plot(x, [r[3] * 1e6 for r in sel], "o-", label=f"neuron, {nproc} ranks")
        ax.plot(x, [r[4] * 1e6 for r in sel], "s--", label=f"gloo, {nproc} ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all_reduce size (bytes, fp32)")
    ax.set_ylabel("time per call (us)")
    ax.set_title("all_reduce: neuron process group vs gloo, same ranks, same run")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
