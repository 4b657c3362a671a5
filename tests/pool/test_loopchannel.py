"""neuronmp.pool.loopchannel: an event loop that sends to and reads a core itself."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

import neuronmp
from neuronmp.pool.loopchannel import LoopAnswer, channel_for
from neuronmp.session.model import model_of
from neuronmp.session.session import current as _current_session


@pytest.fixture
def small_rings(emulated, monkeypatch):
    """One core whose rings hold two large requests at most (64 KiB, the least)."""
    emulated("1x1")
    monkeypatch.setenv("NEURONMP_RING_BYTES", "64KiB")   # read when the runtime starts


def test_a_full_ring_waits_for_room_and_never_drops(small_rings):
    # each request is 24 KiB: the ring takes two; the rest wait in order for the
    # worker to free room (it writes the readiness fd), none is dropped or reordered
    model = neuronmp.trace(lambda x: x * 2 + 1, torch.zeros(1, 6144), device_time=2000)
    session, core, mid = model_of(model).target(0)
    worker = session.pool._workers[core]
    xs = [torch.full((1, 6144), float(i)) for i in range(24)]

    async def scenario():
        loop = asyncio.get_running_loop()
        channel = channel_for(worker, loop)
        got = [loop.create_future() for _ in xs]

        def done(i):
            return lambda ok, value, on_loop: got[i].set_result((ok, value))

        for i, x in enumerate(xs):
            channel.send(mid, (1, x), LoopAnswer(loop, channel.thread, done(i)))
        results = await asyncio.wait_for(asyncio.gather(*got), 60)
        waits = channel.full_waits
        channel.detach()
        return results, waits

    results, waits = asyncio.run(scenario())
    assert waits > 0                                  # the ring did fill up
    for x, (ok, outs) in zip(xs, results):
        assert ok and torch.equal(outs[0], x * 2 + 1)
    assert worker.owner is None
    # the synchronous path reads the core again once the loop gave it back
    assert torch.equal(model(xs[3]), xs[3] * 2 + 1)


def test_the_readiness_fd_is_one_per_core_and_closed_with_the_pool(emulated):
    emulated("1x1")
    model = neuronmp.trace(lambda x: x + 1, torch.zeros(1, 4))
    model(torch.zeros(1, 4))
    pool = _current_session().pool
    worker = pool._workers[pool.cores[0]]
    fd = worker.ready_fd
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    # the worker holds its own copy (passed over the forkserver's socket)
    theirs = [os.readlink(f"/proc/{worker.pid}/fd/{n}")
              for n in os.listdir(f"/proc/{worker.pid}/fd")]
    assert "anon_inode:[eventfd]" in theirs
    neuronmp.shutdown()
    assert worker.ready_fd == -1       # closed by its one owner, the core's coordinator
