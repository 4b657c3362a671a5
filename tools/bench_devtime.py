"""Device-time cores: DataParallel and the BatchingServer against the exact ceiling.

Each emulated core takes ``--cost-us`` (default 2000) per batch of 32 rows and sleeps
through it (see neuronmp.host.devicetime), so the ceiling is exact: cores / cost.  The model
is a small Linear traced at 32 rows, so the runtime's own cost is what is measured.

  DP 1 thread    one thread calls DataParallel(batch 32 x cores) in a loop
  DP async       --callers threads call it at once (calls overlap on the cores)
  server         BatchingServer (the model on every core, two lanes per core, max
                 batch 32) with --clients single-sample asyncio callers; its ceiling
                 is Little's law's: min(cores x 32, clients) rows per cost (each
                 caller has one request in flight); "caller CPU" is this process's
                 CPU use (1.0 = one CPU); "1 client p50" is one asyncio caller's
                 median latency on the same server afterwards (the cost plus the
                 server's own path); "CPU us/req" is this process's CPU per request
                 served, and "null" the same for the null server (what asyncio callers
                 cost against a server of zero cost)
  1-thread floor what one calling thread must spend per DataParallel call outside the
                 modelled time, at the least, measured here with the real workers
                 running: the C ring puts of N prebuilt requests (no Python around
                 them; one C call for all, as DataParallel sends them, where the tree
                 has it), the least bookkeeping a request needs (its Pending, id,
                 pending entry, lock, counter), the cut of the input into N row ranges (one C
                 call, as DataParallel makes them: ipc.codec.Rows), and one
                 timer wake-up after the last chunk is due (slept as the runtime
                 sleeps, timer slack 1 ns); "/ceil" is the share of
                 the ceiling that leaves, cost / (cost + floor), and "spun /ceil"
                 the same without the wake-up's lateness (a caller that spins
                 through the due time on CPUs the workers share): no one-thread
                 DataParallel that publishes chunk by chunk can beat the latter
  null server    the baseline for that column: the same callers against a server
                 that does nothing but batch -- a thread per core (at most one per
                 32 callers: fewer, fuller batches, its best case) takes up to 32
                 queued requests, sleeps the modelled time and answers them in bulk
                 to the event loop (no tensors, no workers, no rings): what asyncio
                 callers in one Python process reach on this host with a runtime of
                 zero cost

  server by caller (the second table; --paths-only runs it alone): a fresh server
                 per case, --clients one-row callers (a count per core count, default
                 64 on the first, 256 on the rest): "threads" (blocking infer calls),
                 "loop" (infer_async on one event loop), "loop after sync" (the same,
                 on a server whose first call was one synchronous infer), and
                 "threads+loop" (half each, at once); each against the null batcher
                 for the same callers in the same run (a thread per core taking up to
                 32, sleeping the modelled time, answering in bulk: a thread caller
                 blocks on a lock it releases, the loop's futures are set in one
                 call_soon_threadsafe), with the requests the server's stats counted
                 on each path; "tensor null" is the same null batcher answering each
                 request with its row of one batch output (one split per batch, the
                 row returned to its caller, who drops it, as every caller of a
                 server does): what handing each caller a tensor costs by itself --
                 torch releases the GIL for every tensor it frees and inside every
                 op, so a blocking caller's answer costs it a second round of the
                 GIL (docs/performance.md, "The batching server")

Each core count runs in a fresh process on an emulated host of that many cores.
``--dp-runs 5`` repeats the one-thread DataParallel column and prints each run's share
(its target holds in every run); ``--dp-only`` skips the other columns:

    python tools/bench_devtime.py --cores 32 --dp-only --dp-runs 5

Used by tools/bench_dp.py --device-time; also runnable alone:

    python tools/bench_devtime.py --cores 2,8,32
    python tools/bench_devtime.py --cores 2,8 --clients 64,256 --paths-only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent("""
    import asyncio, json, os, statistics, sys, threading, time, torch, neuronmp
    try:
        from neuronmp.batching import BatchingServer
    except ImportError:   # a checkout from before the move (a same-run baseline)
        from neuronmp.serve import BatchingServer
    cost, seconds, callers, clients = float(sys.argv[1]), float(sys.argv[2]), \\
        int(sys.argv[3]), int(sys.argv[4])
    dp_runs, dp_only, paths_only = int(sys.argv[5]), sys.argv[6] == "1", sys.argv[7] == "1"
    n = neuronmp.core_count()
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 4).eval()
    traced = neuronmp.trace(net, torch.rand(32, 16), device_time=cost)
    dp = neuronmp.DataParallel(traced)
    x = torch.rand(32 * n, 16)

    def loop(fn, stop, counts, i):
        while time.perf_counter() < stop:
            fn()
            counts[i] += 1

    def rate(fn, threads, rows):
        fn()
        counts = [0] * threads
        stop = time.perf_counter() + seconds
        t0 = time.perf_counter()
        ts = [threading.Thread(target=loop, args=(fn, stop, counts, i)) for i in range(threads)]
        for t in ts: t.start()
        for t in ts: t.join()
        return sum(counts) * rows / (time.perf_counter() - t0)

    server_cpu = 0.0

    def floor_us(rounds=200):
        # see the module docstring; private parts on purpose: what is timed is the
        # least a call does, not the runtime's way of doing it
        from neuronmp.session import chunking
        from neuronmp.ipc import _frames, codec
        from neuronmp.shm import _waits
        from neuronmp.pool import protocol as P
        from neuronmp.pool.answer import Pending
        put_many = getattr(_frames, "put_many", None)   # None: a tree from before it
        records = [m._loaded for m in dp._replicas]
        pool = records[0].session.pool
        targets = [r.targets[0] for r in records]
        workers = [pool._workers[core] for core, _ in targets]
        pc, med = time.perf_counter_ns, statistics.median
        puts, books, splits, lates = [], [], [], []
        spec = (codec.CODE[x.dtype], (32, *x.shape[1:]))
        for i in range(rounds):
            parts = chunking.row_ranges([x], [32] * n, [spec])[0]   # as DataParallel does
            reqs = [(P.RUN, 10**12 + i * n + k, mid, (1, parts[k]), pc())
                    for k, (_, mid) in enumerate(targets)]
            time.sleep(cost / 1e6 * 1.5)    # the cores' modelled queues are empty again
            t0 = pc()
            if put_many is not None:    # as DataParallel sends them: one C call
                rings = [w.req for w in workers]
                heads = put_many([(r._buf, req, r._head, r._max_inline)
                                  for r, req in zip(rings, reqs)], False)
                for r, head in zip(rings, heads):
                    r._head = head
            else:
                for w, req in zip(workers, reqs):
                    ring = w.req
                    ring._head = _frames.put(ring._buf, req, ring._head, ring._max_inline, 2)
            puts.append(pc() - t0)
            for w in workers:
                w.req.wake_reader()
            t0, pending = pc(), {}
            for w, req in zip(workers, reqs):
                answer = Pending(w)
                with w.lock:
                    pending[next(pool._ids)] = (answer, req)
                    w.submits += 1
            books.append(pc() - t0)
            t0 = pc()
            chunking.row_ranges([x], [32] * n, [spec])
            splits.append(pc() - t0)
            due = pc() + int(cost * 1e3)     # slept as a caller waits for a due answer
            _waits.sleep_until(due, due)
            lates.append(pc() - due)
        dp(x)   # the workers' answers to the requests above are read and dropped
        return {k: med(v) / 1e3 for k, v in
                (("puts", puts), ("books", books), ("split", splits), ("late", lates))}

    def null_served(cores, clients):
        # the paths table's null batcher from one loop, with its CPU per request
        thread_call, loop_call, close = null_batcher(cores, clients)
        c0 = time.process_time()
        try:
            rate_ = run_case(thread_call, loop_call, 0, clients)
        finally:
            close()
        out["null_cpu_us"] = (time.process_time() - c0) / max(rate_ * seconds, 1) * 1e6
        return rate_

    async def served(server, sample, clients):
        global server_cpu
        async def one(stop, counts, i):
            while time.perf_counter() < stop:
                await server.infer_async(sample)
                counts[i] += 1
        await server.infer_async(sample)
        counts = [0] * clients
        stop = time.perf_counter() + seconds
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(stop, counts, i) for i in range(clients)))
        wall = time.perf_counter() - t0
        server_cpu = (time.process_time() - c0) / wall
        out["server_cpu_us"] = (time.process_time() - c0) / max(sum(counts), 1) * 1e6
        return sum(counts) / wall

    async def one_client(server, sample, rounds=400):
        # a lone caller's latency: the modelled time plus the server's own path
        took = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await server.infer_async(sample)
            took.append(time.perf_counter() - t0)
        return statistics.median(took) * 1e6

    def run_case(thread_call, loop_call, threads, clients):
        # ``threads`` blocking callers and ``clients`` asyncio callers (on one loop in
        # a thread of its own) at once, for ``seconds`` from when all are ready;
        # requests (one row each) per second
        counts, done, stop = [0] * threads, [0], [float("inf")]
        ready = threading.Barrier(threads + (1 if clients else 0) + 1)
        def blocking(i):
            ready.wait()
            while time.perf_counter() < stop[0]:
                thread_call()
                counts[i] += 1
        def on_loop():
            async def one():
                n = 0
                while time.perf_counter() < stop[0]:
                    await loop_call()
                    n += 1
                return n
            async def main():
                ready.wait()
                done[0] = sum(await asyncio.gather(*(one() for _ in range(clients))))
            asyncio.run(main())
        ts = [threading.Thread(target=blocking, args=(i,)) for i in range(threads)]
        if clients:
            ts.append(threading.Thread(target=on_loop))
        for t in ts: t.start()
        ready.wait()
        t0 = time.perf_counter()
        stop[0] = t0 + seconds
        for t in ts: t.join()
        return (sum(counts) + done[0]) / (time.perf_counter() - t0)

    def null_batcher(cores, waiters, tensors=False):
        # the server's shape with its work taken out (see the module docstring):
        # a thread per core takes up to 32 waiting requests, sleeps the modelled
        # time and answers them in bulk: a thread's by releasing the lock it
        # blocks on, the loop's futures in one call_soon_threadsafe.  ``tensors``:
        # each request is answered with its row of one batch output (one split per
        # batch), which its caller returns and drops, as a server's callers do
        queue, cv, stopping = [], threading.Condition(), []
        out_rows, ones = torch.zeros(32, 4), [1] * 32
        def answer_futures(futs):
            for (_, f), v in futs:
                f.set_result(v)
        def core():
            while True:
                with cv:
                    while not queue and not stopping:
                        cv.wait()
                    if stopping:
                        return
                    batch = queue[:32]
                    del queue[:32]
                due = time.perf_counter() + cost / 1e6
                time.sleep(max(0.0, due - time.perf_counter()))
                values = out_rows.split_with_sizes(ones) if tensors else [None] * 32
                futs = []
                for w, v in zip(batch, values):
                    if type(w) is tuple:
                        futs.append((w[1], v))
                    elif tensors:
                        w.value = v
                        w.lock.release()
                    else:
                        w.release()
                if futs:
                    futs[0][0][0].call_soon_threadsafe(answer_futures, futs)
        def put(w):
            with cv:
                queue.append(w)
                if len(queue) == 1 or len(queue) % 32 == 0:   # not one wake per request
                    cv.notify()
        def thread_call():
            lock = threading.Lock()
            lock.acquire()
            put(lock)
            lock.acquire()
        def thread_call_tensor():
            w = NullWaiter()
            put(w)
            w.lock.acquire()
            value, w.value = w.value, None
            return value
        def loop_call():
            loop = asyncio.get_running_loop()
            f = loop.create_future()
            put((loop, (loop, f)))
            return f
        threads = [threading.Thread(target=core, daemon=True)
                   for _ in range(min(cores, -(-waiters // 32)))]
        for t in threads: t.start()
        def close():
            with cv:
                stopping.append(True)
                cv.notify_all()
            for t in threads: t.join()
        return (thread_call_tensor if tensors else thread_call), loop_call, close

    class NullWaiter:
        # a blocking caller of the tensor null: the lock it blocks on, its row
        __slots__ = ("lock", "value")
        def __init__(self):
            self.lock = threading.Lock()
            self.lock.acquire()
            self.value = None

    def paths(traced, n, clients):
        # each case on a fresh server: its callers and what called it first
        sample = torch.rand(1, 16)
        half = clients // 2
        cases = (("threads", clients, 0, False), ("loop", 0, clients, False),
                 ("loop after sync", 0, clients, True),
                 ("threads+loop", half, clients - half, False))
        got = {}
        for name, threads, loop_clients, sync_first in cases:
            server = BatchingServer(traced, max_batch_size=32, max_queue_delay_ms=0.1)
            server.infer(sample)
            if not sync_first:
                server.close()
                server = BatchingServer(traced, max_batch_size=32, max_queue_delay_ms=0.1)
            c0 = time.process_time()
            rate_ = run_case(lambda: server.infer(sample), lambda: server.infer_async(sample),
                             threads, loop_clients)
            cpu = time.process_time() - c0
            # (a checkout from before the paths, a same-run baseline, counts none)
            by_path = server.stats().get("by_path", {})
            server.close()
            got[name] = {"server": rate_, "cpu_us": cpu / max(rate_ * seconds, 1) * 1e6,
                         "threads_req": by_path.get("threads", {}).get("submitted", "-"),
                         "loop_req": by_path.get("event_loop", {}).get("submitted", "-")}
        return got, cases

    def null_paths(n, clients, cases, tensors=False):
        got = {}
        for name, threads, loop_clients, _ in cases:
            if name == "loop after sync":
                continue
            tc, lc, close = null_batcher(n, threads + loop_clients, tensors)
            got[name] = run_case(tc, lc, threads, loop_clients)
            close()
        got["loop after sync"] = got["loop"]
        return got

    out = {"cores": n, "ceiling": n * 32 / (cost / 1e6), "clients": clients,
           "load": os.getloadavg()[0]}
    if not paths_only:
        # the one-thread case's target holds in every run, so each run is kept
        out["dp1_runs"] = [rate(lambda: dp(x), 1, 32 * n) for _ in range(dp_runs)]
        out["dp1"] = statistics.median(out["dp1_runs"])
        if dp_only:
            out["floor"] = floor_us()
            neuronmp.shutdown()
            print(json.dumps(out))
            sys.exit(0)
        out["dpasync"] = rate(lambda: dp(x), callers, 32 * n)
        out["floor"] = floor_us()
    neuronmp.set_multicore(traced)   # the server runs where its model is placed
    if not paths_only:
        server = BatchingServer(traced, max_batch_size=32, max_queue_delay_ms=0.1)
        sample = torch.rand(1, 16)
        out["server"] = asyncio.run(served(server, sample, clients))
        out["p50_1"] = asyncio.run(one_client(server, sample))
        out["server_cpu"] = server_cpu
        server.close()
    out["server_ceiling"] = min(n * 32, clients) / (cost / 1e6)  # Little's law
    out["paths"], cases = paths(traced, n, clients)
    neuronmp.shutdown()
    if not paths_only:
        out["null"] = null_served(n, clients)
    nulls = null_paths(n, clients, cases)
    tensor_nulls = null_paths(n, clients, cases, tensors=True)
    for name, row in out["paths"].items():
        row["null"] = nulls[name]
        row["tensor_null"] = tensor_nulls[name]
    print(json.dumps(out))
""")


def measure(cores: int, cost_us: float, seconds: float, callers: int, clients: int,
            dp_runs: int = 1, dp_only: bool = False, paths_only: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="nmp-bench-", dir="/dev/shm") as rundir:
        env = dict(os.environ, NEURONMP_RUNTIME_DIR=rundir,
                   NEURONMP_TOPOLOGY=f"{max(1, cores // 2)}x{min(cores, 2)}")
        env.pop("NEURON_RT_VISIBLE_CORES", None)
        env.pop("NEURON_RT_NUM_CORES", None)
        res = subprocess.run([sys.executable, "-c", _CHILD, str(cost_us), str(seconds),
                              str(callers), str(clients), str(dp_runs),
                              "1" if dp_only else "0", "1" if paths_only else "0"],
                             env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{cores} cores failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def print_table(rows, cost_us: float, callers: int) -> None:
    print(f"\nDevice-time cores ({cost_us:g} us per batch of 32 rows): rows/s and share "
          "of the exact ceiling (cores / cost)\n")
    head = (f"{'cores':>5} {'ceiling':>9} {'DP 1 thread':>12} {'/ceil':>6} "
            f"{f'DP {callers} threads':>13} {'/ceil':>6} {'server':>11} {'ceiling':>9} "
            f"{'/ceil':>6} {'caller CPU':>10} {'null server':>11} {'/ceil':>6} "
            f"{'server/null':>11} {'1 client p50 us':>15} {'CPU us/req':>10} {'null':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        c = r["ceiling"]
        print(f"{r['cores']:>5} {c:>9.0f} {r['dp1']:>12.0f} {r['dp1'] / c:>6.2f} "
              f"{r['dpasync']:>13.0f} {r['dpasync'] / c:>6.2f} {r['server']:>11.0f} "
              f"{r['server_ceiling']:>9.0f} {r['server'] / r['server_ceiling']:>6.2f} "
              f"{r['server_cpu']:>10.2f} {r['null']:>11.0f} "
              f"{r['null'] / r['server_ceiling']:>6.2f} {r['server'] / r['null']:>11.2f} "
              f"{r['p50_1']:>15.0f} {r['server_cpu_us']:>10.2f} {r['null_cpu_us']:>6.2f}")
    print("\nOne calling thread's floor per DataParallel call, median us (see the module "
          "docstring), against what DP 1 thread reached\n")
    head = (f"{'cores':>5} {'C puts':>7} {'bookkeeping':>11} {'split':>6} {'timer late':>10} "
            f"{'floor':>6} {'/ceil':>6} {'spun /ceil':>10} {'DP 1 thread /ceil':>17}")
    print(head)
    print("-" * len(head))
    for r in rows:
        f = r["floor"]
        spun = f["puts"] + f["books"] + f["split"]
        total = spun + max(0.0, f["late"])
        print(f"{r['cores']:>5} {f['puts']:>7.0f} {f['books']:>11.0f} {f['split']:>6.0f} "
              f"{f['late']:>10.0f} {total:>6.0f} {cost_us / (cost_us + total):>6.2f} "
              f"{cost_us / (cost_us + spun):>10.2f} {r['dp1'] / r['ceiling']:>17.2f}")


def print_paths(rows, cost_us: float) -> None:
    print(f"\nThe BatchingServer by caller ({cost_us:g} us per batch of 32 rows, one-row "
          "requests, each caller one in flight): rows/s against the null batcher's for the "
          "same callers in the same run; 'requests on' is what the server's stats "
          "counted on each path\n")
    head = (f"{'cores':>5} {'callers':>7} {'case':<16} {'server':>9} {'null':>9} "
            f"{'server/null':>11} {'tensor null':>11} {'server/tensor null':>18} "
            f"{'/ceil':>6} {'CPU us/req':>10} {'requests on threads / loop':>27}")
    print(head)
    print("-" * len(head))
    for r in rows:
        for name, p in r["paths"].items():
            tnull = p["tensor_null"]
            print(f"{r['cores']:>5} {r['clients']:>7} {name:<16} {p['server']:>9.0f} "
                  f"{p['null']:>9.0f} {p['server'] / p['null']:>11.2f} {tnull:>11.0f} "
                  f"{p['server'] / tnull:>18.2f} "
                  f"{p['server'] / r['server_ceiling']:>6.2f} {p['cpu_us']:>10.1f} "
                  f"{p['threads_req']:>13} / {p['loop_req']:<11}")


def print_dp_runs(rows, cost_us: float) -> None:
    print(f"\nDataParallel from one thread, device-time cores ({cost_us:g} us per batch of "
          "32 rows): each run's share of the exact ceiling (target >= 0.95 in every run)\n")
    for r in rows:
        shares = [d / r["ceiling"] for d in r["dp1_runs"]]
        f = r["floor"]
        spun = f["puts"] + f["books"] + f["split"]
        # what each call took beyond its modelled time, from the runs' rates
        over = [32 * r["cores"] / d * 1e6 - cost_us for d in r["dp1_runs"]]
        print(f"{r['cores']:>3} cores  runs /ceil: {' '.join(f'{v:.2f}' for v in shares)}  "
              f"worst {min(shares):.2f}  (load average {r['load']:.1f}; one-thread floor "
              f"{spun + max(0.0, f['late']):.0f} us: /ceil "
              f"{cost_us / (cost_us + spun + max(0.0, f['late'])):.2f}; floor parts us: "
              f"puts {f['puts']:.0f} books {f['books']:.0f} split {f['split']:.0f} "
              f"late {f['late']:.0f}; a call's time over the cost, us: "
              f"{' '.join(f'{v:.0f}' for v in over)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="2,8,32", help="comma list of emulated core counts")
    ap.add_argument("--cost-us", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=3.0, help="per column")
    ap.add_argument("--callers", type=int, default=4, help="threads for 'DP async'")
    ap.add_argument("--clients", default="64,256",
                    help="server callers per core count, in --cores order (the last "
                    "repeats for the rest)")
    ap.add_argument("--paths-only", action="store_true",
                    help="only the server by caller (threads, loop, loop after a "
                    "synchronous call, both) against the null batcher")
    ap.add_argument("--plot", metavar="PATH",
                    help="also draw DataParallel's scaling as a PNG (matplotlib), its "
                    "figures in PATH.json beside it")
    ap.add_argument("--dp-runs", type=int, default=1,
                    help="runs of the one-thread DataParallel column (each one's share "
                    "printed: its target holds in every run)")
    ap.add_argument("--dp-only", action="store_true",
                    help="only the one-thread DataParallel runs and its floor, e.g. "
                    "--cores 32 --dp-only --dp-runs 5")
    args = ap.parse_args(argv)
    if args.dp_runs < 1:
        ap.error(f"--dp-runs must be at least 1, got {args.dp_runs}")
    if args.dp_only and (args.plot or args.paths_only):
        ap.error("--dp-only runs only DataParallel: it cannot go with --plot or --paths-only")
    cores = [int(c) for c in args.cores.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    clients += [clients[-1]] * (len(cores) - len(clients))
    rows = []
    for n, k in zip(cores, clients):
        rows.append(measure(n, args.cost_us, args.seconds, args.callers, k,
                            args.dp_runs, args.dp_only, args.paths_only))
        print(f"  measured {n} cores", file=sys.stderr, flush=True)
    if not (args.paths_only or args.dp_only):
        print_table(rows, args.cost_us, args.callers)
    if args.dp_runs > 1 or args.dp_only:
        print_dp_runs(rows, args.cost_us)
    if not args.dp_only:
        print_paths(rows, args.cost_us)
    if args.plot and not args.paths_only:
        import plotting

        fig = plotting.devtime_figure(rows, args.cost_us, args.callers, sys.argv[1:])
        print("plot:", plotting.save(fig, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
