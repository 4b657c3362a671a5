#!/usr/bin/env python3
"""What reserving every core of a big emulated host costs.

For each topology: reserve all its cores (``reservation.reserve`` with no
NEURON_RT_* request), read them back without locking (``core_states``, what
neuronmp-ls and refusals do), and release them.  The baseline, measured in the
same run on the same file system, is the floor any one-lock-file-per-core
scheme pays: open + flock one file per core and write one small record per
core by tmp + rename, in a bare loop.  ``x floor`` is reserve / that floor.

The issue's target: all 4096 cores of ``64x64`` in at most 2 s (it took 30 s
when every core's record listed every core of the reservation).

    python tools/bench_reserve.py [--repeat N] [--topologies 4x4,16x16,32x32,64x64]
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from neuronmp.host import reservation, topology  # noqa: E402
from neuronmp.host.visibility import Request  # noqa: E402

_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _floor(n: int, directory: str) -> float:
    """Bare system calls for n cores: lock one file each, write one record each."""
    record = b'{"pid": 1, "start": 1, "host": "h", "command": "python x.py", "first": 0}'
    t0 = time.perf_counter()
    fds = []
    for core in range(n):
        fd = os.open(os.path.join(directory, f"nc{core}.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fds.append(fd)
        tmp = os.path.join(directory, f"nc{core}.holder.tmp")
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(wfd, record)
        os.close(wfd)
        os.replace(tmp, os.path.join(directory, f"nc{core}.holder"))
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return elapsed


def _one(spec: str, root: str) -> dict:
    topo = topology.parse(spec, cpus=[0])
    base = tempfile.mkdtemp(dir=root)
    os.environ["NEURONMP_RUNTIME_DIR"] = base
    try:
        t0 = time.perf_counter()
        held = reservation.reserve(Request(), topo)
        t1 = time.perf_counter()
        states = reservation.core_states(topo.num_cores)
        t2 = time.perf_counter()
        held.release()
        t3 = time.perf_counter()
        assert len(held.cores) == topo.num_cores and all(s.held for s in states)
        floor_dir = tempfile.mkdtemp(dir=root)
        floor = _floor(topo.num_cores, floor_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(floor_dir, ignore_errors=True)
    return {"reserve": t1 - t0, "states": t2 - t1, "release": t3 - t2, "floor": floor}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per topology; medians shown")
    ap.add_argument("--topologies", default="4x4,16x16,32x32,64x64")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="nmp-bench-reserve-", dir=_SHM)
    os.chmod(root, 0o700)
    try:
        print(f"{'topology':>9} {'cores':>6} {'reserve s':>10} {'view s':>8} "
              f"{'release s':>10} {'floor s':>8} {'x floor':>8}")
        for spec in args.topologies.split(","):
            runs = [_one(spec.strip(), root) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            n = topology.parse(spec.strip(), cpus=[0]).num_cores
            print(f"{spec:>9} {n:>6} {med['reserve']:>10.3f} {med['states']:>8.3f} "
                  f"{med['release']:>10.3f} {med['floor']:>8.3f} "
                  f"{med['reserve'] / med['floor']:>8.2f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
