#!/usr/bin/env python3
"""Memory of many workers holding one big model: PSS and USS summed over the workers.

Each row runs in a fresh interpreter with its own runtime directory, emulating
``--topology`` (default trn1.32xlarge, 32 NeuronCores), with one model traced
inside ``multicore_context`` (so every core holds it) and called once on every
core (its pages are touched), then reads psutil's ``memory_full_info`` of every
worker:

  * tiny:   a Linear(4, 4): the per-worker baseline (torch, the runtime, rings);
  * shared: an MLP of three Linear(4096, 4096) layers (201 MB of float32
            weights), shared weights on (the default);
  * copies: the same MLP with NEURONMP_SHARE_WEIGHTS=0 (each worker loads its
            own copy, as before shared weights), on ``--copies-cores`` cores
            (default 8: 32 copies of 200 MB, plus their load buffers, would take
            over 12 GB of this machine), extrapolated per worker to the full count.

PSS splits each shared page among the processes mapping it, so the workers' PSS
sum counts a shared copy once; USS counts only pages no other process maps.
Target: shared PSS sum <= 1.3 x (one copy + the tiny row's PSS sum).

    python tools/bench_memory.py [--topology trn1.32xlarge] [--copies-cores 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
_MB = 1e6


def _child(kind: str, width: int) -> dict:
    """In a fresh interpreter: trace the model on every core, call it on each, measure."""
    import psutil
    import torch

    import neuronmp
    from neuronmp.session.session import current

    if kind == "tiny":
        net = torch.nn.Linear(4, 4)
    else:
        net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3)))
    x = torch.zeros(1, net[0].in_features if kind != "tiny" else 4)
    copy = sum(p.numel() * p.element_size() for p in net.parameters())
    with neuronmp.multicore_context():
        traced = neuronmp.trace(net.eval(), x)
    del net
    pool = current().pool
    for _ in pool.cores:   # round robin: every core runs it once
        traced(x)
    workers = [psutil.Process(pool.worker_pid(c)).memory_full_info() for c in pool.cores]
    me = psutil.Process().memory_full_info()
    out = {
        "workers": len(workers),
        "copy": copy,
        "pss": sum(m.pss for m in workers),
        "uss": sum(m.uss for m in workers),
        "rss": sum(m.rss for m in workers),
        "caller_rss": me.rss,
        "segments": sum(w.nbytes for w in pool.shared_weights()),
    }
    neuronmp.shutdown()
    return out


def _run(kind: str, topology: str, cores: int, share: bool, width: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_memory as b; print(json.dumps(b._child({kind!r}, {width})))")
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir=_SHM) as rundir:
        env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir, NEURONMP_TOPOLOGY=topology,
                   NEURON_RT_VISIBLE_CORES=f"0-{cores - 1}",
                   NEURONMP_SHARE_WEIGHTS="1" if share else "0")
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=1800)
    if res.returncode:
        raise SystemExit(f"{kind} on {cores} cores failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="trn1.32xlarge", help="NEURONMP_TOPOLOGY to emulate")
    ap.add_argument("--cores", type=int, default=32, help="workers (cores) to start")
    ap.add_argument("--copies-cores", type=int, default=8,
                    help="workers for the NEURONMP_SHARE_WEIGHTS=0 row")
    ap.add_argument("--width", type=int, default=4096, help="MLP width (4096: 201 MB)")
    args = ap.parse_args(argv)

    n, m = args.cores, args.copies_cores
    tiny = _run("tiny", args.topology, n, True, args.width)
    shared = _run("big", args.topology, n, True, args.width)
    tiny_m = tiny if m == n else _run("tiny", args.topology, m, True, args.width)
    copies = _run("big", args.topology, m, False, args.width)
    copy = shared["copy"]

    print(f"{n} workers ({args.topology}), MLP 3 x Linear({args.width}, {args.width}): "
          f"one copy of its weights = {copy / _MB:.0f} MB; MB summed over the workers")
    print("| row | workers | PSS sum | USS sum | RSS sum | PSS per worker | "
          "PSS / (one copy + the baselines) |")
    print("|---|---|---|---|---|---|---|")
    rows = [("tiny model (baseline)", tiny, None), ("200 MB, shared weights", shared, tiny)]
    if m != n:
        rows.append(("tiny model (baseline)", tiny_m, None))
    rows.append(("200 MB, NEURONMP_SHARE_WEIGHTS=0", copies, tiny_m))
    for label, r, base in rows:
        ratio = "" if base is None else f"{r['pss'] / (copy + base['pss']):.2f}"
        print(f"| {label} | {r['workers']} | {r['pss'] / _MB:,.0f} | {r['uss'] / _MB:,.0f} | "
              f"{r['rss'] / _MB:,.0f} | {r['pss'] / r['workers'] / _MB:.0f} | {ratio} |")
    if m != n:   # each copy costs what it cost on m workers; the baselines as measured on n
        extra = (copies["pss"] - tiny_m["pss"]) / m
        pss = tiny["pss"] + n * extra
        print(f"| 200 MB, NEURONMP_SHARE_WEIGHTS=0, extrapolated | {n} | {pss / _MB:,.0f} | | | "
              f"{pss / n / _MB:.0f} | {pss / (copy + tiny['pss']):.2f} |")
    ratio = shared["pss"] / (copy + tiny["pss"])
    print(f"\nshared: {shared['pss'] / _MB:,.0f} MB PSS for {n} workers = {ratio:.2f} x "
          f"(one copy {copy / _MB:.0f} MB + {n} baselines {tiny['pss'] / _MB:,.0f} MB); "
          f"target at most 1.3x")
    print(f"the caller's own RSS: {shared['caller_rss'] / _MB:,.0f} MB with the big model "
          f"(tiny: {tiny['caller_rss'] / _MB:,.0f} MB); weight segments: "
          f"{shared['segments'] / _MB:.0f} MB")
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
