#!/usr/bin/env python3
"""Benchmark the shared-memory ring against the usual ways to move tensors.

For tensors of 64 B .. 64 MiB it measures, in one run:
  * echo round trip (p50, p99): parent sends, a child process sends it back;
  * one-way throughput: parent streams frames, the child receives each one.
Transports: neuronmp.ipc.ring.Ring, multiprocessing.Pipe (send_bytes/recv_bytes of
the raw bytes), torch.multiprocessing.Queue (tensors), and a bare memcpy into
and out of a shared-memory segment in one process (the physical limit).

Then the stop-and-wait row, large frames as DataParallel sends them: the parent
sends one 16 MiB tensor, the child takes it as a view (recv_view, as workers
do), reads every byte once (a sum), releases it and answers with the 0-d sum;
the parent waits for that answer before the next frame.  Baseline: one memcpy
of the tensor into warm memory of this process and the same sum of it.  One
iteration of the baseline and of each ring (the pool's default capacity, where
the frame goes on a spill arena, and a 64 MiB ring, where it goes inline) run
in turn, so all share the host's moments of load.

    python tools/bench_ipc.py [--quick] [--sizes 64,4096] [--capacity BYTES]
    python tools/bench_ipc.py --stop-and-wait [--rounds N] [--slice-us 100]
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as tmp

from neuronmp.ipc.ring import Ring
from neuronmp.shm.segment import Segment

try:
    from neuronmp.ipc import _frames as _copies
except ImportError:  # a checkout from before the C helper's split, for before/after tables
    from neuronmp.ipc import _sync as _copies

SIZES = (64, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
SAW_SIZE = 16 << 20  # a DataParallel chunk of images, about
_STOP = -1


def _label(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _iters(size: int, kind: str, quick: bool) -> int:
    base = {64: 20000, 4 << 10: 10000, 64 << 10: 3000, 1 << 20: 400, 16 << 20: 40, 64 << 20: 12}
    n = base.get(size, max(10, (64 << 20) // max(size, 1)))
    if kind == "queue":
        n = max(10, min(n, 2000) // 4)
    if quick:
        n = max(5, n // 10)
    return n


def _pin(cpu: int) -> None:
    """Keep each side on one thread (pinning to CPUs hurts on a shared host)."""
    torch.set_num_threads(1)


def _tensor(size: int) -> torch.Tensor:
    return torch.randint(0, 255, (size,), dtype=torch.uint8)


# -- children -----------------------------------------------------------------

def _ring_child(req_name: str, resp_name: str, mode: str) -> None:
    _pin(1)
    req, resp = Ring.attach(req_name), Ring.attach(resp_name)
    dst = None
    try:
        while True:
            if mode == "echo":
                with req.recv_view() as frame:
                    if frame.value is None:
                        break
                    resp.send(frame.value)
            else:
                # consume each frame the way the memcpy baseline does: one copy out of
                # shared memory into memory the receiver already owns
                if dst is None:
                    with req.recv_view() as frame:
                        x = frame.value
                        if x is None:
                            break
                        if isinstance(x, int):
                            resp.send(x)  # end of a throughput burst
                            continue
                        dst = torch.empty_like(x)
                        dst.copy_(x)
                        del x
                    continue
                try:
                    req.recv_into(dst)
                except ValueError:  # not a tensor: a control message
                    x = req.recv()
                    if x is None:
                        break
                    resp.send(x)
    finally:
        req.close()
        resp.close()


def _pipe_child(conn, mode: str) -> None:
    _pin(1)
    while True:
        b = conn.recv_bytes()
        if b == b"stop":
            break
        if mode == "echo" or b == b"ack":
            conn.send_bytes(b)


def _queue_child(qin, qout, mode: str) -> None:
    _pin(1)
    dst = None
    while True:
        x = qin.get()
        if isinstance(x, int):
            if x == _STOP:
                break
            qout.put(x)
        elif mode == "echo":
            qout.put(x)
        else:  # consume like the ring's reader: one copy into memory it owns
            if dst is None or dst.shape != x.shape:
                dst = torch.empty_like(x)
            dst.copy_(x)
        del x


def _saw_child(req_name: str, resp_name: str, slice_us: float) -> None:
    """The stop-and-wait reader: view, one read, release, a tiny answer with its
    own clock readings (CLOCK_MONOTONIC, the same in both processes) and the CPU
    time it spent reading."""
    _pin(1)
    _set_slice(slice_us)
    req, resp = Ring.attach(req_name), Ring.attach(resp_name)
    try:
        while True:
            with req.recv_view() as frame:
                t_view, c0 = time.perf_counter(), time.thread_time()
                x = frame.value
                if x is None:
                    break
                total = x.sum()
                del x
            resp.send((total, t_view, time.perf_counter(), time.thread_time() - c0))
    finally:
        req.close()
        resp.close()


# -- transports: each returns (echo latencies in s, throughput in B/s) ---------

def _ring(size: int, n_echo: int, n_tput: int, capacity: int):
    ctx = mp.get_context("fork")
    x = _tensor(size)
    lat = []
    for mode in ("echo", "tput"):
        req, resp = Ring.create(capacity), Ring.create(capacity)
        try:
            child = ctx.Process(target=_ring_child, args=(req.name, resp.name, mode))
            child.start()
            req.set_peer((child.pid, _start(child.pid)))
            resp.set_peer((child.pid, _start(child.pid)))
            if mode == "echo":
                for _ in range(min(50, n_echo)):
                    req.send(x)
                    resp.recv()
                for _ in range(n_echo):
                    t0 = time.perf_counter()
                    req.send(x)
                    resp.recv()
                    lat.append(time.perf_counter() - t0)
            else:
                req.send(x)
                req.send(0)
                resp.recv()
                t0 = time.perf_counter()
                for _ in range(n_tput):
                    req.send(x)
                req.send(1)
                resp.recv()
                tput = size * n_tput / (time.perf_counter() - t0)
            req.send(None)
            child.join()
        finally:
            req.close()
            resp.close()
    return lat, tput


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


def _set_slice(us: float) -> None:
    """Ask for a scheduler slice of ``us`` microseconds for this thread (0: the
    kernel's default), same policy (SCHED_OTHER) and nice.  A shorter slice does
    not buy CPU time: EEVDF gives the task an earlier deadline, so a wake-up
    preempts a running CPU hog sooner.  For the busy-host measurements only."""
    number = _SCHED_SETATTR.get(os.uname().machine)
    if number is None:
        raise SystemExit(f"--slice-us: no sched_setattr number known for {os.uname().machine}")
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), policy=0,
                      nice=os.getpriority(os.PRIO_PROCESS, 0), runtime=int(us * 1000))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.byref(attr), 0):
        raise SystemExit(f"--slice-us: sched_setattr failed: {os.strerror(ctypes.get_errno())}")


def _default_ring_bytes() -> int:
    """The pool's ring capacity (NEURONMP_RING_BYTES, else its default)."""
    from neuronmp.pool import limits

    return limits.ring_bytes()


def _start(pid: int) -> int:
    from neuronmp.host import procid

    return procid.start_time(pid)


def _pipe(size: int, n_echo: int, n_tput: int):
    ctx = mp.get_context("fork")
    x = _tensor(size).numpy()
    lat = []
    for mode in ("echo", "tput"):
        a, b = ctx.Pipe()
        child = ctx.Process(target=_pipe_child, args=(b, mode))
        child.start()
        if mode == "echo":
            for _ in range(min(50, n_echo)):
                a.send_bytes(x)
                a.recv_bytes()
            for _ in range(n_echo):
                t0 = time.perf_counter()
                a.send_bytes(x)
                torch.frombuffer(bytearray(a.recv_bytes()), dtype=torch.uint8)
                lat.append(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            for _ in range(n_tput):
                a.send_bytes(x)
            a.send_bytes(b"ack")
            a.recv_bytes()
            tput = size * n_tput / (time.perf_counter() - t0)
        a.send_bytes(b"stop")
        child.join()
        a.close()
        b.close()
    return lat, tput


def _queue(size: int, n_echo: int, n_tput: int):
    ctx = tmp.get_context("fork")
    # a fresh tensor per message, as a new request or result would be: a tensor the
    # queue has already moved to shared memory would travel as a bare handle
    fresh = [_tensor(size) for _ in range(max(n_tput, n_echo + 20))]
    lat = []
    for mode in ("echo", "tput"):
        qin, qout = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_queue_child, args=(qin, qout, mode))
        child.start()
        if mode == "echo":
            for i in range(min(20, n_echo)):
                qin.put(fresh[-1 - i])
                qout.get()
            for i in range(n_echo):
                x = fresh[i]
                t0 = time.perf_counter()
                qin.put(x)
                qout.get()
                lat.append(time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            for i in range(n_tput):
                qin.put(fresh[i])
            qin.put(0)
            qout.get()
            tput = size * n_tput / (time.perf_counter() - t0)
        qin.put(_STOP)
        child.join()
        for q in (qin, qout):
            q.close()
            q.join_thread()
    return lat, tput


def _memcpy(size: int, n_echo: int, n_tput: int):
    """One process, no peer: copy into shared memory and out again."""
    seg = Segment.create(max(size, 1))
    try:
        src, dst = _tensor(size), torch.empty(size, dtype=torch.uint8)
        sp, dp = src.data_ptr(), dst.data_ptr()
        mm = seg.buf
        lat = []
        for _ in range(n_echo):
            t0 = time.perf_counter()
            for _ in range(2):  # there and back
                _copies.copy_in(mm, 0, sp, size)
                _copies.copy_out(mm, 0, dp, size)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(n_tput):
            _copies.copy_in(mm, 0, sp, size)
            _copies.copy_out(mm, 0, dp, size)
        tput = size * n_tput / (time.perf_counter() - t0)
    finally:
        seg.close()
    return lat, tput


class _SawRing:
    """One ring pair and its stop-and-wait reader; ``once`` times one exchange."""

    def __init__(self, capacity: int, size: int, slice_us: float = 0.0):
        self.capacity = capacity
        self.slice_us = slice_us
        self.label = f"{_label(capacity)} {'inline' if size < capacity // 2 else 'arena'}"
        if slice_us:
            self.label += f", {slice_us:g} us slice"
        self.req, self.resp = Ring.create(capacity), Ring.create(capacity)
        self.child = mp.get_context("fork").Process(
            target=_saw_child, args=(self.req.name, self.resp.name, slice_us))
        self.child.start()
        peer = (self.child.pid, _start(self.child.pid))
        self.req.set_peer(peer)
        self.resp.set_peer(peer)
        # per exchange, seconds from the send: send returned, the reader has its
        # view, the reader is done reading, the answer is here; then CPU seconds
        # of the writer's send and of the reader's read
        self.marks: list = []

    def once(self, x: torch.Tensor, want: float, keep: bool) -> None:
        if self.slice_us:
            _set_slice(self.slice_us)
        t0, c0 = time.perf_counter(), time.thread_time()
        self.req.send(x)
        t_sent, c_sent = time.perf_counter(), time.thread_time()
        total, t_view, t_read, c_read = self.resp.recv()
        t_end = time.perf_counter()
        if self.slice_us:
            _set_slice(0)
        if float(total) != want:
            raise AssertionError(f"the reader summed {float(total)}, expected {want}")
        if keep:
            self.marks.append((t_sent - t0, t_view - t0, t_read - t0, t_end - t0,
                               c_sent - c0, c_read))

    def close(self) -> None:
        try:
            self.req.send(None)
            self.child.join()
        finally:
            self.req.close()
            self.resp.close()


def _stop_and_wait(size: int, rounds: int, capacities, slice_us: float = 0.0) -> dict:
    """Print the stop-and-wait table (see the module docstring); {capacity: ratio}
    of the rings run with the scheduler's default slice."""
    n = size // 4
    src = torch.rand(n)
    dst = torch.empty(n)
    want = float(src.sum())
    base: list = []

    def baseline(keep: bool) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        dst.copy_(src)  # one memcpy into memory this process has used before
        c1 = time.thread_time()
        got = float(dst.sum())  # one read of every byte
        if keep:
            base.append((time.perf_counter() - t0, c1 - c0, time.thread_time() - c1))
        if got != want:
            raise AssertionError(f"the baseline summed {got}, expected {want}")

    rings: list = []
    try:
        for cap in capacities:
            rings.append(_SawRing(cap, size))
            if slice_us:
                rings.append(_SawRing(cap, size, slice_us))
        steps = [baseline] + [lambda keep, r=r: r.once(src, want, keep) for r in rings]
        warm = 5
        for i in range(warm + rounds):
            # each in turn goes first: the first after a wait has a fresh
            # scheduler slice, the later ones are more likely to be preempted
            k = i % len(steps)
            for step in steps[k:] + steps[:k]:
                step(i >= warm)
    finally:
        for r in rings:
            r.close()
    med = statistics.median
    b = med(t for t, _, _ in base)
    print()
    print(f"stop-and-wait: one {_label(size)} frame, then a tiny answer; {rounds} rounds, "
          "baseline and rings in turn; ms")
    print("  baseline: memcpy into warm memory + one read (sum), one process; "
          "ratio = baseline p50 / ring p50")
    print("  from the send (p50): send returned, reader has the view, has read it, "
          "answer back; CPU: writer's send, reader's read")
    w = max(len(r.label) for r in rings)
    print(f"{'':>{w}} | {'p50':>6} {'p90':>6} | {'ratio':>5} || {'sent':>6} {'viewed':>6} "
          f"{'read':>6} {'answer':>6} | {'CPU wr':>6} {'rd':>5}")
    bc = [med(x[k] for x in base) for k in (1, 2)]
    print(f"{'baseline':>{w}} | {b * 1e3:6.2f} {_pct([t for t, _, _ in base], .9) * 1e3:6.2f} | "
          f"{1:5.2f} || {'':>6} {'':>6} {'':>6} {'':>6} | {bc[0] * 1e3:6.2f} {bc[1] * 1e3:5.2f}")
    out = {}
    for r in rings:
        total = [m[3] for m in r.marks]
        p50 = med(total)
        m = [med(x[k] for x in r.marks) * 1e3 for k in range(6)]
        if not r.slice_us:
            out[r.capacity] = b / p50
        print(f"{r.label:>{w}} | {p50 * 1e3:6.2f} {_pct(total, .9) * 1e3:6.2f} | {b / p50:5.2f} || "
              f"{m[0]:6.2f} {m[1]:6.2f} {m[2]:6.2f} {m[3]:6.2f} | {m[4]:6.2f} {m[5]:5.2f}",
              flush=True)
    return out


# -- report ---------------------------------------------------------------------

def _pct(lat, q):
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(q * len(lat)))]


def _us(s):
    return f"{s * 1e6:9.1f}" if s < 0.1 else f"{s * 1e3:7.1f}ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10x fewer iterations")
    ap.add_argument("--sizes", help="comma list of tensor sizes in bytes")
    ap.add_argument("--capacity", type=int, default=64 << 20,
                    help="ring capacity in bytes (default 64 MiB: frames up to 32 MiB "
                    "travel in the ring, bigger ones on a one-off segment)")
    ap.add_argument("--stop-and-wait", action="store_true",
                    help="only the stop-and-wait row (16 MiB frames, default and 64 MiB rings)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="stop-and-wait rounds (default 60, 20 with --quick)")
    ap.add_argument("--slice-us", type=float, default=0.0,
                    help="stop-and-wait: also run each ring with both processes asking the "
                    "kernel for this scheduler slice (EEVDF, Linux 6.6+; e.g. 100)")
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw the echo and throughput table as a PNG (matplotlib), "
                    "its figures in PATH.json beside it")
    args = ap.parse_args(argv)
    if args.slice_us:
        _set_slice(0)  # refuse an unsupported kernel before any child starts
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SIZES)

    own_dir = None
    if not os.environ.get("NEURONMP_RUNTIME_DIR"):
        own_dir = tempfile.mkdtemp(prefix="neuronmp-bench-", dir="/dev/shm")
        os.environ["NEURONMP_RUNTIME_DIR"] = own_dir
    _pin(0)
    torch.set_num_threads(1)
    print(f"# bench_ipc: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, ring capacity {_label(args.capacity)}, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    results = {}
    rounds = args.rounds or (20 if args.quick else 60)
    if args.stop_and_wait:
        sizes = []
    for size in sizes:
        row = {}
        for kind in ("ring", "pipe", "queue", "memcpy"):
            n_echo = _iters(size, kind, args.quick)
            n_tput = max(4, n_echo // 2)
            if kind == "ring":
                row[kind] = _ring(size, n_echo, n_tput, args.capacity)
            elif kind == "pipe":
                row[kind] = _pipe(size, n_echo, n_tput)
            elif kind == "queue":
                row[kind] = _queue(size, n_echo, n_tput)
            else:
                row[kind] = _memcpy(size, n_echo, n_tput)
        results[size] = row
        _print_row(size, row)
    saw = _stop_and_wait(SAW_SIZE, rounds, (_default_ring_bytes(), 64 << 20), args.slice_us)
    if own_dir:
        from neuronmp.host import liveness

        liveness.release()  # this process's .live file: it owns no segment now
        shutil.rmtree(own_dir)
    if args.plot and results:
        import plotting

        print("plot:", plotting.save(plotting.ring_figure(results, _label, sys.argv[1:]),
                                     args.plot))
    return _verdict(results, saw)


_printed_header = False


def _print_row(size, row):
    global _printed_header
    if not _printed_header:
        print()
        print("echo round trip, microseconds (p50 / p99); ratio = other p50 / ring p50")
        print("  throughput one-way, GB/s; ratio = ring / other")
        print(f"{'size':>8} | {'ring p50':>9} {'p99':>9} | {'pipe p50':>9} {'p99':>9} "
              f"{'x':>6} | {'tmpQ p50':>9} {'p99':>9} {'x':>7} | {'memcpy':>9} || "
              f"{'ring':>6} {'pipe':>6} {'tmpQ':>6} {'memcpy':>6} | {'/pipe':>5} "
              f"{'/tmpQ':>5} {'/memcpy':>7}")
        _printed_header = True
    ring, pipe, q, mc = (row[k] for k in ("ring", "pipe", "queue", "memcpy"))
    p50 = {k: statistics.median(v[0]) for k, v in row.items()}
    gb = {k: v[1] / 1e9 for k, v in row.items()}
    print(f"{_label(size):>8} | {_us(p50['ring'])} {_us(_pct(ring[0], .99))} | "
          f"{_us(p50['pipe'])} {_us(_pct(pipe[0], .99))} {p50['pipe'] / p50['ring']:6.1f} | "
          f"{_us(p50['queue'])} {_us(_pct(q[0], .99))} {p50['queue'] / p50['ring']:7.1f} | "
          f"{_us(p50['memcpy'])} || {gb['ring']:6.2f} {gb['pipe']:6.2f} {gb['queue']:6.2f} "
          f"{gb['memcpy']:6.2f} | {gb['ring'] / gb['pipe']:5.1f} {gb['ring'] / gb['queue']:5.1f} "
          f"{gb['ring'] / gb['memcpy']:7.2f}", flush=True)


def _verdict(results, saw) -> int:
    checks = []
    if 64 in results:
        r = results[64]
        p = {k: statistics.median(v[0]) for k, v in r.items()}
        checks.append(("64 B echo p50 >= 4x lower than Pipe", p["pipe"] / p["ring"], 4))
        checks.append(("64 B echo p50 >= 100x lower than torch mp Queue",
                       p["queue"] / p["ring"], 100))
    if 16 << 20 in results:
        r = results[16 << 20]
        checks.append(("16 MiB throughput >= 0.7x memcpy", r["ring"][1] / r["memcpy"][1], 0.7))
        checks.append(("16 MiB throughput >= 3x torch mp Queue",
                       r["ring"][1] / r["queue"][1], 3))
    checks += [(f"16 MiB stop-and-wait on a {_label(cap)} ring >= 0.7x memcpy + read", x, 0.7)
               for cap, x in saw.items()]
    print()
    ok = True
    for text, got, want in checks:
        good = got >= want
        ok &= good
        print(f"{'PASS' if good else 'FAIL'}  {text}: {got:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
