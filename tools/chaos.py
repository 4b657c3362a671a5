"""Chaos: every kind of caller under load while workers are SIGKILLed and SIGSTOPped.

    python tools/chaos.py [--seconds 20] [--seed N]     one JSON line of counts

Callers: threads calling a traced model, an asyncio loop awaiting model answers and a
BatchingServer that loop serves (it owns the model's cores, which the threads' server
shares), DataParallel over every core, threads calling another BatchingServer.  The
model computes ``x * 2 + 1`` and no two requests share an input value, so an answer
meant for another request is caught.  Meanwhile a killer thread SIGKILLs or SIGSTOPs
a random worker every 0.2-0.8 s (``NEURON_RT_EXEC_TIMEOUT`` is 2 s, so a stopped one
is replaced).  Every request ends in exactly one of: ok, failed with a named neuronmp
error (``failed``, by type), ``wrong`` (an answer unequal to x*2+1), ``unexpected``
(any other error), ``hung`` (a call that outlived its bound).  After the run the
runtime shuts down and ``leaks`` lists what is left: worker processes, files in the
runtime directory.  tests/test_chaos.py runs it bounded; set NEURONMP_CHAOS_SECONDS
(or --seconds) for a longer run.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
import warnings

os.environ.setdefault("NEURON_RT_EXEC_TIMEOUT", "2")  # read when the pool first loads

import psutil  # noqa: E402
import torch  # noqa: E402

import neuronmp  # noqa: E402
from neuronmp.batching import BatchingServer  # noqa: E402
from neuronmp.session import model as _model  # noqa: E402
from neuronmp.session import session as _session  # noqa: E402

NAMED = (neuronmp.WorkerDiedError, neuronmp.ExecTimeoutError, neuronmp.RequestTimeoutError,
         neuronmp.PeerDiedError)
BOUND = 30.0  # seconds past which a call counts as hung (exec timeout 2 s + restarts)
COLS = 8


class Affine(torch.nn.Module):
    """x * 2 + 1, after a little work (adds 0), so kills also hit running requests."""

    def forward(self, x):
        w = torch.ones(160, 160, dtype=x.dtype)
        return x * 2 + 1 + (w @ w).sum() * 0


class Tally:
    """Outcome counts, shared by every caller."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.failed = collections.Counter()
        self.unexpected = collections.Counter()
        self.longest = 0.0
        self.values = itertools.count(1)

    def batch(self, rows: int) -> torch.Tensor:
        """Inputs no other request has: consecutive integers (exact in float32)."""
        with self.lock:
            base = next(self.values) * rows * COLS
        return torch.arange(base, base + rows * COLS, dtype=torch.float32).view(rows, COLS)

    def outcome(self, x: torch.Tensor, call) -> None:
        t0 = time.monotonic()
        try:
            out = call()
            kind, name = ("ok" if torch.equal(out, x * 2 + 1) else "wrong"), None
        except NAMED as exc:
            kind, name = "failed", type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - that is what is counted
            kind, name = "unexpected", f"{type(exc).__name__}: {exc}"[:200]
        self.record(kind, name, time.monotonic() - t0)

    def record(self, kind: str, name, took: float) -> None:
        with self.lock:
            self.counts["requests"] += 1
            self.counts["hung" if took > BOUND else kind] += 1
            if kind == "failed":
                self.failed[name] += 1
            elif kind == "unexpected":
                self.unexpected[name] += 1
            self.longest = max(self.longest, took)


def _loop(until: float, body) -> None:
    while time.monotonic() < until:
        body()


def _asyncio_caller(until: float, tally: Tally, model, server) -> None:
    async def one(x, make):
        t0 = time.monotonic()
        try:
            out = await asyncio.wait_for(make(), BOUND + 5)
            kind, name = ("ok" if torch.equal(out, x * 2 + 1) else "wrong"), None
        except NAMED as exc:
            kind, name = "failed", type(exc).__name__
        except Exception as exc:  # noqa: BLE001
            kind, name = "unexpected", f"{type(exc).__name__}: {exc}"[:200]
        tally.record(kind, name, time.monotonic() - t0)

    async def main():
        while time.monotonic() < until:
            xs = [tally.batch(2) for _ in range(4)]
            ys = [tally.batch(1)[0] for _ in range(4)]

            async def answer(x):
                outs = await asyncio.wrap_future(model.submit([x]))
                return outs[0]

            await asyncio.gather(*(one(x, lambda x=x: answer(x)) for x in xs),
                                 *(one(y, lambda y=y: server.infer_async(y)) for y in ys))

    asyncio.run(main())


def _killer(until: float, rng: random.Random, done: collections.Counter) -> None:
    pool = _session.current().pool
    while time.monotonic() < until:
        time.sleep(rng.uniform(0.2, 0.8))
        core = rng.choice(pool.cores)
        sig = signal.SIGKILL if rng.random() < 0.6 else signal.SIGSTOP
        try:
            os.kill(pool.worker_pid(core), sig)
            done[signal.Signals(sig).name] += 1
        except (ProcessLookupError, TypeError, neuronmp.PoolClosedError):  # none running
            pass


def _leaks(runtime_dir: str) -> list:
    left = [f"file {os.path.relpath(os.path.join(d, n), runtime_dir)}"
            for d, dirs, files in os.walk(runtime_dir) for n in files]
    deadline = time.monotonic() + 5
    while True:
        kids = [p for p in psutil.Process().children(recursive=True)
                if "multiprocessing" not in " ".join(_cmdline(p))]
        if not kids or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return left + [f"process {p.pid} {' '.join(_cmdline(p))[:60]}" for p in kids]


def _cmdline(p: psutil.Process) -> list:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def run(seconds: float, seed: int) -> dict:
    warnings.simplefilter("ignore")  # DataParallel's uneven-split warning
    rng = random.Random(seed)
    tally = Tally()
    cores = len(neuronmp.visible_cores())
    traced = neuronmp.trace(Affine(), torch.zeros(2, COLS))
    served = neuronmp.trace(Affine(), torch.zeros(2, COLS))
    model = _model.model_of(neuronmp.dynamic_batch(traced))
    dp = neuronmp.DataParallel(neuronmp.trace(Affine(), torch.zeros(2, COLS)))
    server = BatchingServer(served, max_batch_size=4, timeout=BOUND)
    # called from the asyncio loop only: batched on that loop (neuronmp.batching.loop)
    loop_server = BatchingServer(served, max_batch_size=4, timeout=BOUND)
    kills: collections.Counter = collections.Counter()
    start = time.monotonic()
    until = start + seconds
    rows = 2 * cores + 1

    def traced_call():
        x = tally.batch(2)
        tally.outcome(x, lambda: traced(x))

    def dp_call():
        x = tally.batch(rows)
        tally.outcome(x, lambda: dp(x))

    def served_call():
        x = tally.batch(1)[0]
        tally.outcome(x, lambda: server.infer(x))

    threads = [threading.Thread(target=_loop, args=(until, body), daemon=True)
               for body in (traced_call, traced_call, traced_call, dp_call, served_call,
                            served_call)]
    threads.append(threading.Thread(target=_asyncio_caller,
                                    args=(until, tally, model, loop_server),
                                    daemon=True))
    # the last stops are replaced (2 s) before the callers stop
    threads.append(threading.Thread(target=_killer, args=(until - 3, rng, kills), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, until + BOUND + 10 - time.monotonic()))
    hung_threads = sum(t.is_alive() for t in threads)
    server.close()
    loop_server.close()
    neuronmp.shutdown()
    report = dict(tally.counts)
    report.update(failed_by_type=dict(tally.failed), unexpected=dict(tally.unexpected),
                  hung_threads=hung_threads, longest_s=round(tally.longest, 2),
                  signals=dict(kills), seconds=round(time.monotonic() - start, 1), seed=seed,
                  leaks=_leaks(os.environ["NEURONMP_RUNTIME_DIR"]))
    for key in ("requests", "ok", "failed", "wrong", "unexpected_count", "hung"):
        report.setdefault(key, 0)
    report["unexpected_count"] = sum(tally.unexpected.values())
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("NEURONMP_CHAOS_SECONDS", "20")))
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    args = ap.parse_args(argv)
    if "NEURONMP_RUNTIME_DIR" not in os.environ:
        os.environ["NEURONMP_RUNTIME_DIR"] = f"/dev/shm/neuronmp-chaos-{os.getpid()}"
    report = run(args.seconds, args.seed)
    print(json.dumps(report, sort_keys=True), flush=True)
    bad = report["wrong"] or report["unexpected_count"] or report["hung"] or \
        report["hung_threads"] or report["leaks"]
    sys.stdout.flush()
    os._exit(1 if bad else 0)  # hung daemon threads must not keep the process


if __name__ == "__main__":
    main()
