#!/usr/bin/env python3
"""How long until every worker of a pool is ready, and what a request costs.

Table 1, start-up: time from constructing the pool until all its workers have
attached their rings, pinned their CPUs and greeted the coordinator, for 2 and
16 emulated cores, with workers started

  * from neuronmp's forkserver (torch imported once, workers forked), cold:
    the forkserver itself is started in the measured time, as on a first run;
  * the same, warm: a second pool in the same process reuses the forkserver;
  * with multiprocessing's plain ``spawn`` (each worker imports torch itself),
    the baseline a user would otherwise pick.

Every measurement runs in a fresh interpreter, so nothing is cached between them.

Table 2, request overhead: p50/p99 round trip of a model returning its input
(64 B tensor, one core) through the pool, against the bare ring echo of the
same tensor between two processes (no futures, no threads, no model).  The pool's
row is a blocking caller's (the answer a traced call, DataParallel and the
server's lanes wait on); "pool.call -> Future" is the same request answered
with the real ``concurrent.futures.Future`` that ``submit()`` hands out.

Table 3, 32 emulated cores on this machine (``--big``; trn1.32xlarge), each row
in a fresh interpreter, against a baseline from the same run:

  * 32 workers ready (forkserver cold, the forkserver's ``import torch``
    included) against a cold ``python -c "import torch"`` (target: 2x);
  * a 200 MB MLP (three Linear(4096, 4096)) loaded on all 32 cores with
    ``torch.jit.load`` inside ``multicore_context`` (workers already up), and as
    32 DataParallel replicas, against ``torch.jit.load`` of the same model
    without neuronmp, once, in a fresh interpreter of its own (target: 3x);
    the same with the weights kept on tmpfs (``NEURONMP_WEIGHTS_DIR=shm``), what
    the default chose before it could put them in the page cache;
  * the CPU the 32 idle workers use over one second (sum of their CPU times).

    python tools/bench_startup.py [--repeat N] [--cores 2,16] [--big]
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

_SHM = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _one_startup(method: str, cores: int) -> dict:
    """Run in a child interpreter: build pools, report their start times."""
    import torch  # noqa: F401  (the coordinator needs it anyway; not what we time)

    from neuronmp.host import topology
    from neuronmp.pool.coordinator import Pool

    topo = topology.parse(f"1x{cores}")
    out = {}
    t0 = time.perf_counter()
    pool = Pool(range(cores), topo, start_method=method)
    out["cold"] = time.perf_counter() - t0
    pool.close()
    if method == "forkserver":
        t0 = time.perf_counter()
        pool = Pool(range(cores), topo, start_method=method)
        out["warm"] = time.perf_counter() - t0
        pool.close()
    return out


def _measure(method: str, cores: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_startup as b; print(json.dumps(b._one_startup({method!r}, {cores})))")
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir=_SHM) as rundir:
        env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=600)
    if res.returncode:
        raise SystemExit(f"{method} x{cores} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _plain_load(width: int, workdir: str) -> float:
    """In a fresh interpreter without neuronmp: the baseline, one ``torch.jit.load`` of
    the same 200 MB model.  Measured inside the 32 cores' process it read 0.29-0.35 s
    against 0.10 s alone (the workers settling after their start), and flattered the
    ratios."""
    import torch

    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3))).eval()
    plain = os.path.join(workdir, "plain.pt")
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(net, torch.zeros(1, width)), plain)
    del net
    t0 = time.perf_counter()
    torch.jit.load(plain)
    return time.perf_counter() - t0


def _big_load(width: int, workdir: str) -> dict:
    """In a fresh interpreter: the 200 MB model loaded on all cores (multicore_context,
    DataParallel), and the idle workers' CPU."""
    import psutil
    import torch

    import neuronmp
    from neuronmp.host import procid
    from neuronmp.session.model import models_in
    from neuronmp.session.session import current

    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(3))).eval()
    x = torch.zeros(1, width)
    traced = os.path.join(workdir, "nmp.pt")
    with neuronmp.neuron_cores_context(0, 1):
        torch.jit.save(neuronmp.trace(net, x), traced)
    del net
    pool = current().pool   # every worker up: what is timed below is the load alone
    out = {}
    t0 = time.perf_counter()
    with neuronmp.neuron_cores_context(0, 1):
        model = torch.jit.load(traced)
    out["one_core"] = time.perf_counter() - t0
    del model
    t0 = time.perf_counter()
    with neuronmp.multicore_context():
        model = torch.jit.load(traced)
    out["multicore"] = time.perf_counter() - t0
    assert len(models_in(model)[0].cores) == len(pool.cores)
    shm = os.path.join(os.environ["NEURONMP_RUNTIME_DIR"], "shm")
    out["where"] = ",".join("tmpfs" if os.path.dirname(w.segment.path) == shm else "page cache"
                            for w in pool.shared_weights()) or "a copy per core"
    for _ in pool.cores:
        model(x)
    del model
    with neuronmp.neuron_cores_context(0, 1):
        one = torch.jit.load(traced)
    t0 = time.perf_counter()
    dp = neuronmp.DataParallel(one)
    out["dataparallel"] = time.perf_counter() - t0
    dp(torch.zeros(len(pool.cores), width))
    workers = [psutil.Process(pool.worker_pid(c)) for c in pool.cores]
    time.sleep(0.5)   # the last calls' spinning and answers are over

    def cpu():
        return sum(procid.cpu_seconds(w.pid) for w in workers)

    c0, t0 = cpu(), time.perf_counter()
    time.sleep(1.0)
    out["idle_cpu"] = (cpu() - c0) / (time.perf_counter() - t0)
    out["cores"] = len(pool.cores)
    neuronmp.shutdown()
    return out


def _measure_plain(width: int) -> float:
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_startup as b; print(b._plain_load({width}, sys.argv[1]))")
    with tempfile.TemporaryDirectory(prefix="nmp-bench-") as work:
        res = subprocess.run([sys.executable, "-c", code, work], capture_output=True,
                             text=True, timeout=600)
    if res.returncode:
        raise SystemExit(f"the plain 200 MB load failed:\n{res.stderr}")
    return float(res.stdout.strip().splitlines()[-1])


def _measure_big(width: int, cores: int = 32, share: bool = True, where: str = "auto") -> dict:
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_startup as b; print(json.dumps(b._big_load({width}, sys.argv[1])))")
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir=_SHM) as rundir, \
            tempfile.TemporaryDirectory(prefix="nmp-bench-") as work:
        env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir, NEURONMP_TOPOLOGY="trn1.32xlarge",
                   NEURON_RT_VISIBLE_CORES=f"0-{cores - 1}",
                   NEURONMP_SHARE_WEIGHTS="1" if share else "0", NEURONMP_WEIGHTS_DIR=where)
        res = subprocess.run([sys.executable, "-c", code, work], env=env, capture_output=True,
                             text=True, timeout=1800)
    if res.returncode:
        raise SystemExit(f"the 200 MB load failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _import_torch() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def _big_table(repeat: int, width: int) -> int:
    imports, ready = [], []
    for _ in range(repeat):   # alternated, so both see the host's moments of load
        imports.append(_import_torch())
        with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir=_SHM) as rundir:
            env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir)
            code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                    "import bench_startup as b; "
                    "print(json.dumps(b._one_startup('forkserver', 32)))")
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=600)
        if res.returncode:
            raise SystemExit(f"32 workers failed:\n{res.stderr}")
        ready.append(json.loads(res.stdout.strip().splitlines()[-1])["cold"])
    loads, plains, shms = [], [], []
    for _ in range(repeat):   # alternated too
        loads.append(_measure_big(width))
        plains.append(_measure_plain(width))
        shms.append(_measure_big(width, where="shm"))
    copies = _measure_big(width, cores=4, share=False)
    imp, up = statistics.median(imports), statistics.median(ready)
    once = statistics.median(plains)
    one = statistics.median(r["one_core"] for r in loads)
    multi = statistics.median(r["multicore"] for r in loads)
    dp = statistics.median(r["dataparallel"] for r in loads)
    shm = statistics.median(r["multicore"] for r in shms)
    where = sorted({r["where"] for r in loads})
    idle = max(r["idle_cpu"] for r in loads)
    mb = 3 * (width * width + width) * 4 / 1e6
    print(f"\n32 emulated cores (trn1.32xlarge) on {os.cpu_count()} CPUs, median of {repeat}; "
          f"baselines from the same run")
    print("| measure | neuronmp | baseline | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| 32 workers ready, forkserver cold | {up:.2f} s | `import torch`, cold: "
          f"{imp:.2f} s | {up / imp:.2f}x | 2x |")
    base = f"`torch.jit.load` once, plain torch: {once:.2f} s"
    print(f"| {mb:.0f} MB MLP on 1 core, `neuron_cores_context(0, 1)` + `torch.jit.load` | "
          f"{one:.2f} s | {base} | {one / once:.2f}x | |")
    print(f"| the same on all 32, `multicore_context` + `torch.jit.load` | {multi:.2f} s "
          f"| {base} | {multi / once:.2f}x | 3x |")
    print(f"| the same on all 32, `DataParallel` of the 1-core model | {dp:.2f} s | {base} | "
          f"{dp / once:.2f}x | |")
    print(f"| all 32 again, the weights on tmpfs (`NEURONMP_WEIGHTS_DIR=shm`) | {shm:.2f} s | "
          f"{once:.2f} s | {shm / once:.2f}x | |")
    print(f"| `NEURONMP_SHARE_WEIGHTS=0`, on 4 cores (`multicore_context`) | "
          f"{copies['multicore']:.2f} s | {once:.2f} s | "
          f"{copies['multicore'] / once:.2f}x | |")
    print(f"| CPU of 32 idle workers over 1 s (worst run) | {idle * 100:.2f}% of one CPU | | | |")
    print(f"\nthe 200 MB weights went to: {', '.join(where)} (NEURONMP_WEIGHTS_DIR=auto)")
    return int(up > 2 * imp or multi > 3 * once)


def _echo_child(req_name, resp_name, parent):
    from neuronmp.ipc.ring import Ring

    req, resp = Ring.attach(req_name), Ring.attach(resp_name)
    req.set_peer(parent)
    resp.set_peer(parent)
    while True:
        frame = req.recv_view()
        msg = frame.value
        if msg is None:
            frame.release()
            break
        resp.send(msg)
        frame.release()
    req.close()
    resp.close()


def _lat(fn, n):
    for _ in range(n // 10):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    out.sort()
    return out[len(out) // 2], out[int(len(out) * 0.99)]


def _overhead(n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir=_SHM) as rundir:
        os.environ["NEURONMP_RUNTIME_DIR"] = rundir
        return _overhead_in(n)


def _overhead_in(n: int) -> dict:
    import io
    import multiprocessing as mp

    import torch

    import neuronmp
    from neuronmp.host import procid, topology
    from neuronmp.ipc.ring import Ring
    from neuronmp.pool.coordinator import Pool

    x = torch.zeros(16)  # 64 B
    req, resp = Ring.create(8 << 20), Ring.create(8 << 20)
    child = mp.get_context("fork").Process(
        target=_echo_child, args=(req.name, resp.name, tuple(procid.current())))
    child.start()
    ident = procid.of(child.pid)
    req.set_peer(ident)
    resp.set_peer(ident)

    def echo():
        req.send((1, 1, 1, (x,)))
        resp.recv()

    ring = _lat(echo, n)
    req.send(None)
    child.join()
    req.close()
    resp.close()

    class Identity(torch.nn.Module):
        def forward(self, t):
            return t

    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(Identity(), x), buf)
    pool = Pool([0], topology.parse(None))  # core 0 of the default host: one CPU of its own
    mid = pool.load(0, buf.getvalue())
    # a blocking caller's answer (what a traced call, DataParallel and the server's
    # lanes wait on) and the Future answer submit() hands out (a real
    # concurrent.futures.Future: its Condition and lock rounds are its own cost)
    pooled = _lat(lambda: pool.call(0, mid, (x,), future=False).result(), n)
    future = _lat(lambda: pool.call(0, mid, (x,)).result(), n)
    pool.close()
    # what a user calls: the object neuronmp.trace returns, on one core of its own
    os.environ["NEURON_RT_VISIBLE_CORES"] = "0"
    traced_model = neuronmp.trace(Identity(), x)
    traced = _lat(lambda: traced_model(x), n)
    neuronmp.shutdown()
    del os.environ["NEURON_RT_VISIBLE_CORES"]
    return {"ring": ring, "pool": pooled, "future": future, "traced": traced}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="start-up runs per cell (median)")
    ap.add_argument("--cores", default="2,16", help="comma list of emulated core counts")
    ap.add_argument("--requests", type=int, default=5000, help="round trips for table 2")
    ap.add_argument("--big", action="store_true",
                    help="only table 3: 32 cores, a 200 MB model, idle CPU")
    ap.add_argument("--width", type=int, default=4096, help="table 3's MLP width")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.cores.split(",")]
    if args.big:
        return _big_table(args.repeat, args.width)

    print("Start-up: seconds until every worker is ready (median of "
          f"{args.repeat}; each in a fresh interpreter)")
    print(f"{'cores':>5} {'forkserver cold':>16} {'forkserver warm':>16} {'spawn':>8} "
          f"{'spawn/cold':>11} {'cold/spawn':>11}")
    verdict = 0
    for n in counts:
        fs = [_measure("forkserver", n) for _ in range(args.repeat)]
        sp = [_measure("spawn", n)["cold"] for _ in range(args.repeat)]
        cold = statistics.median(r["cold"] for r in fs)
        warm = statistics.median(r["warm"] for r in fs)
        spawn = statistics.median(sp)
        print(f"{n:>5} {cold:>16.2f} {warm:>16.2f} {spawn:>8.2f} {spawn / cold:>10.1f}x "
              f"{cold / spawn:>11.2f}")
        if n == 16 and cold > spawn / 4:
            verdict = 1
    print("target: 16 workers ready (forkserver cold) in at most 1/4 of spawn's time")

    res = _overhead(args.requests)
    print("\nPer-request overhead, 64 B tensor, one core (microseconds)")
    print(f"{'path':<28} {'p50':>8} {'p99':>8}")
    for label, key in (("bare ring echo", "ring"), ("pool.call (identity model)", "pool"),
                       ("pool.call -> Future", "future"),
                       ("traced identity, model(x)", "traced")):
        p50, p99 = res[key]
        print(f"{label:<28} {p50 * 1e6:>8.1f} {p99 * 1e6:>8.1f}")
    ratio = res["pool"][0] / res["ring"][0]
    traced = res["traced"][0] / res["ring"][0]
    print(f"pool / ring p50: {ratio:.2f}x; traced call / ring p50: {traced:.2f}x "
          "(target: at most 3x)")
    if traced > 3:
        verdict = 1
    return verdict


if __name__ == "__main__":
    sys.exit(main())
