"""neuronmp.batching.queue: which queued requests make a batch, whichever path settles them.

The rules are pure logic over a path's queue: these tests queue requests in a real
BatchingServer's threads' queue (no request comes from a caller, so none is sent)
and ask it.
"""
from __future__ import annotations

import time

import pytest
import torch

import neuronmp
from neuronmp.batching import BatchingServer
from neuronmp.batching.queue import Request, pending, start_future
from neuronmp.errors import RequestTimeoutError
from neuronmp.pool.answer import Answer


@pytest.fixture
def server(emulated):
    emulated("1x1")
    model = neuronmp.trace(lambda x: x * 2, torch.zeros(4, 3))
    with BatchingServer(model, 4, 1000, priority_levels=2, warmup=False) as s:
        yield s


def _q(server):
    return server._threads.queue


def _queued(server, rows, level):
    req = Request((torch.zeros(rows, 3),), rows, False, None, Answer(), level)
    with _q(server).lock:
        _q(server).add(req)
    return req


def test_a_batch_takes_level_1_first_fifo_within_a_level_and_stops_at_a_misfit(server):
    low = _queued(server, 1, 1)
    high_a, high_b = _queued(server, 2, 0), _queued(server, 1, 0)
    too_big = _queued(server, 3, 0)   # 2 + 1 + 3 > 4: waits, and level 2 may not jump it
    with _q(server).lock:
        batch = _q(server).take(4, start_future)
        assert batch == [high_a, high_b] and _q(server).waiting == 2 and _q(server).rows == 4
        assert all(r.future.running() for r in batch)
        assert _q(server).take(4, start_future) == [too_big, low]
        assert _q(server).waiting == 0 and _q(server).rows == 0


def test_each_path_skips_the_cancelled_and_the_expired_by_its_own_hook(server):
    cancelled, expired, live = (_queued(server, 1, 0) for _ in range(3))
    assert cancelled.future.cancel()
    expired.future.set_exception(RequestTimeoutError(0.1, "waiting in the queue"))
    with _q(server).lock:
        assert _q(server).take(4, start_future) == [live]   # the threads' path: marked running
    assert live.future.running()
    cancelled, expired, live = (_queued(server, 1, 0) for _ in range(3))
    assert cancelled.future.cancel()
    expired.future.set_exception(RequestTimeoutError(0.1, "waiting in the queue"))
    with _q(server).lock:
        assert _q(server).take(4, pending) == [live]   # the event loop's: left as they are
    assert not live.future.running() and not live.future.done()
    assert server.stats()["batches"] == 2 and server.stats()["rows"] == 2


def test_a_batch_counts_its_requests_queue_time_and_the_skipped_leave_the_queue(server):
    first, skipped, second = (_queued(server, 1, 0) for _ in range(3))
    assert skipped.future.cancel()
    # arrivals set back by known amounts: the batch's queue time is their sum, give
    # or take the moment _take reads the clock
    now = time.monotonic()
    first.arrival, second.arrival = now - 0.5, now - 0.25
    with _q(server).lock:
        assert _q(server).take(4, pending) == [first, second]
        assert _q(server).waiting == 0 and _q(server).rows == 0
    stats = server.stats()
    assert stats["batches"] == 1 and stats["rows"] == 2
    assert 750_000 <= stats["queue_us"] < 750_000 + 2 * 60e6


def test_a_full_batch_is_due_at_once_and_a_partial_one_only_on_a_free_core(server):
    _queued(server, 3, 1)
    with _q(server).lock:
        _q(server).slots.busy[0] = 1   # a batch running: a partial batch waits for company
        assert _q(server).due(free=False)[0] == 0
        _q(server).slots.busy[0] = 0   # nothing running anywhere: an idle server sends at once
        assert _q(server).due(free=True)[0] == 4
    _queued(server, 1, 1)
    with _q(server).lock:
        _q(server).slots.busy[0] = 1
        assert _q(server).due(free=False)[0] == 4   # full: due even behind a running batch
        _q(server).slots.busy[0] = 0


def test_wait_when_idle_keeps_a_partial_batch_for_the_delay_on_an_idle_server(emulated):
    """Triton's rule (wait_when_idle, what neuronmp-serve sets): a partial batch is not
    due on an idle server until its oldest request waited the delay; a full one is."""
    emulated("1x1")
    model = neuronmp.trace(lambda x: x * 2, torch.zeros(4, 3))
    with BatchingServer(model, 4, 1000, warmup=False, wait_when_idle=True) as server:
        first = _queued(server, 3, 0)
        with _q(server).lock:
            assert not _q(server).direct_ok()       # nothing goes straight to a core
            rows, wait = _q(server).due(free=True)
            assert rows == 0 and wait > 0                   # idle, yet it waits for company
            first.arrival -= 2.0                            # its delay (1 s) is over
            assert _q(server).due(free=True)[0] == 4
            first.arrival += 2.0
        _queued(server, 1, 0)
        with _q(server).lock:
            assert _q(server).due(free=True)[0] == 4           # full: due at once
    with pytest.raises(TypeError, match="wait_when_idle"):
        BatchingServer(model, 4, 1000, warmup=False, wait_when_idle="yes")


def test_a_partial_batch_waits_for_the_callers_just_answered_until_they_are_back(server):
    """The threads' path: callers answered by a batch are company on its way back; a
    partial batch waits for them (not for a full batch) and goes when the last is
    back, when it fills meanwhile, or when the delay from the answer is out."""
    q = _q(server)
    _queued(server, 1, 0)
    with q.lock:
        assert q.due(free=True)[0] == 4             # an idle server: at once
        q.answered(2, time.monotonic())             # two callers answered, not back yet
        rows, wait = q.due(free=True)
        assert rows == 0 and 0 < wait <= 1.0        # held, at most the delay (1 s)
        assert not q.direct_ok()                    # and nobody jumps it
        assert q.arrive() is False                  # one of the two is back
        assert q.due(free=True)[0] == 0
        assert q.arrive() is True                   # the last: the batch may go
        assert q.due(free=True)[0] == 4 and q.returning == 0
        q.answered(5, time.monotonic())
    _queued(server, 3, 0)                           # 1 + 3 rows: full
    with q.lock:
        assert q.due(free=True)[0] == 4             # a full batch does not wait for them
        assert len(q.take(4, start_future)) == 2
    _queued(server, 1, 0)
    with q.lock:
        q.returning = 0
        q.answered(1, time.monotonic() - 2.0)       # answered longer than the delay ago
        assert q.due(free=True)[0] == 4 and q.returning == 0   # given up: idle again
        assert q.direct_ok() is False               # (a request is queued)
        q.take(4, start_future)
        q.answered(1, time.monotonic() - 2.0)
        assert q.direct_ok() and q.returning == 0
