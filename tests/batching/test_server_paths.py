"""neuronmp.batching.server: every caller on the path its kind of call needs, in any order.

One server, real workers: a synchronous call, then asyncio callers, then threads, then
threads and two event loops at once.  Which path carried each request is read from the
server's own counters (``stats()["by_path"]``), not from timing.  Then the faults: a
worker killed while threads and a loop wait on its core.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch
from batching.test_loop import _running  # the same wait on a core's request
from batching.test_server import Slow, affine

import neuronmp
from neuronmp import errors
from neuronmp.batching import BatchingServer
from neuronmp.session.session import current as _current_session


@pytest.fixture
def two_cores(emulated):
    emulated("1x2")


def _paths(server):
    p = server.stats()["by_path"]
    return p["threads"]["submitted"], p["event_loop"]["submitted"], p["event_loop"]["event_loops"]


def _threads(server, callers, rounds, base, bad):
    def client(i):
        for j in range(rounds):
            x = torch.full((4,), float(base + i * 1000 + j))
            if not torch.equal(server.infer(x, timeout=60), affine(x)):
                bad.append(("thread", i, j))
    return [threading.Thread(target=client, args=(i,)) for i in range(callers)]


async def _asyncio_callers(server, callers, rounds, base, bad):
    async def one(i):
        for j in range(rounds):
            x = torch.full((4,), float(base + i * 1000 + j))
            if not torch.equal(await server.infer_async(x), affine(x)):
                bad.append(("loop", i, j))
    await asyncio.gather(*(one(i) for i in range(callers)))


def _join(threads):
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller never got its answer"


def test_a_sync_call_then_asyncio_then_threads_then_all_at_once(two_cores):
    model = neuronmp.trace(affine, torch.zeros(4, 4), device_time=1000)
    neuronmp.set_multicore(model)
    bad = []
    with BatchingServer(model, 4, max_queue_delay_ms=1) as server:
        # a synchronous call first: the threads' path, and nothing fixed by it
        x = torch.full((4,), 3.0)
        assert torch.equal(server.infer(x), affine(x))
        assert _paths(server) == (1, 0, 0)

        # asyncio callers next: batched on their own loop, not through threads
        asyncio.run(_asyncio_callers(server, 16, 5, 10_000, bad))
        assert _paths(server) == (1, 80, 1)

        # threads again
        ts = _threads(server, 8, 10, 20_000, bad)
        for t in ts:
            t.start()
        _join(ts)
        assert _paths(server) == (81, 80, 1)

        # both at once: threads and two event loops, each in a thread of its own
        ts = _threads(server, 8, 10, 30_000, bad)
        loops = [threading.Thread(target=lambda b=b: asyncio.run(
            _asyncio_callers(server, 16, 5, b, bad))) for b in (40_000, 50_000)]
        for t in ts + loops:
            t.start()
        _join(ts + loops)
        assert _paths(server) == (161, 240, 3)
        deadline = time.monotonic() + 10
        while server.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = server.stats()
    assert not bad, bad[:5]
    assert stats["completed"] == 401 and stats["failed"] == 0 and stats["running"] == 0
    by_path = stats["by_path"]
    assert by_path["threads"]["rows"] + by_path["event_loop"]["rows"] == 401
    assert stats["batches"] == by_path["threads"]["batches"] + by_path["event_loop"]["batches"]


def test_a_worker_killed_while_threads_and_a_loop_wait_fails_what_it_held(two_cores):
    # one core, one batch at a time: a thread's batch computes (a real product, not
    # device time), loop callers and more threads queue behind it; the worker dies
    model = neuronmp.trace(Slow(2560), torch.zeros(4, 4))
    pool = _current_session().pool
    outcomes, lock = [], threading.Lock()

    def record(kind, got):
        with lock:
            outcomes.append((kind, got))

    with BatchingServer(model, 4, 0, batches_per_core=1) as server:
        core = server.cores[0]
        first = server.submit(torch.ones(4, 4))             # alone on the core
        _running(pool, core, timeout=30.0)
        pid = pool.worker_pid(core)

        def thread_caller(i):
            x = torch.full((4,), float(i))
            try:
                record("thread", (x, server.infer(x, timeout=120)))
            except errors.NeuronmpError as exc:
                record("thread", exc)

        async def loop_callers():
            async def one(i):
                x = torch.full((4,), float(100 + i))
                try:
                    record("loop", (x, await server.infer_async(x)))
                except errors.NeuronmpError as exc:
                    record("loop", exc)
            await asyncio.gather(*(one(i) for i in range(6)))

        callers = [threading.Thread(target=thread_caller, args=(i,)) for i in range(6)]
        callers.append(threading.Thread(target=lambda: asyncio.run(loop_callers())))
        for t in callers:
            t.start()
        deadline = time.monotonic() + 30
        while server.stats()["queued"] < 12:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(errors.WorkerDiedError) as died:
            first.result(timeout=60)
        _join(callers)
        assert died.value.core == core and died.value.pid == pid
        # the queued callers were never sent to the dead worker: the replacement
        # answers them; any that it had read fail naming the core, none hang
        for kind, got in outcomes:
            if isinstance(got, BaseException):
                assert isinstance(got, errors.WorkerDiedError) and got.core == core, got
            else:
                x, y = got
                assert torch.equal(y, affine(x)), (kind, x, y)
        assert sorted(k for k, _ in outcomes) == ["loop"] * 6 + ["thread"] * 6
        deadline = time.monotonic() + 10
        while server.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = server.stats()
        assert pool.worker_pid(core) != pid
    failed = sum(isinstance(g, BaseException) for _, g in outcomes)
    assert stats["failed"] == 1 + failed and stats["completed"] == 12 - failed
    assert stats["running"] == 0 and stats["queued"] == 0
