"""neuronmp.batching.threads: the answer a blocking caller of the threads' path waits on.

``Claimed`` is what ``BatchingServer.infer`` queues instead of a Future: the thread
that read its batch's answer, the clock (timeouts) and ``close`` may each try to
settle it, and the first must win.  Real threads race here; the server-level
behaviour (timeouts, close, worker death through ``infer``) is in
tests/batching/test_server.py.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import InvalidStateError

import pytest
import torch

import neuronmp
from neuronmp.batching import BatchingServer
from neuronmp.batching.queue import start_future
from neuronmp.batching.threads import Claimed
from neuronmp.errors import RequestTimeoutError
from neuronmp.pool.answer import Answer
from neuronmp.pool.answer import wake as wake_answers


def test_the_first_of_racing_settlers_wins_and_the_others_are_refused():
    threads_per_answer, answers = 8, [Claimed() for _ in range(100)]
    start = threading.Barrier(threads_per_answer)
    won = [[] for _ in answers]
    refused = [0] * len(answers)

    def settler(k: int) -> None:
        for i, answer in enumerate(answers):
            start.wait()
            try:
                if k % 2:
                    answer.set_exception(RequestTimeoutError(0.5, "running"))
                else:
                    answer.set_result(k)
                won[i].append(k)
            except InvalidStateError:
                refused[i] += 1

    threads = [threading.Thread(target=settler, args=(k,)) for k in range(threads_per_answer)]
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as CPython will: races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(was)
    assert not any(t.is_alive() for t in threads)
    for i, answer in enumerate(answers):
        assert len(won[i]) == 1 and refused[i] == threads_per_answer - 1
        winner = won[i][0]
        assert answer.done() and answer.wait_done(0)
        if winner % 2:
            with pytest.raises(RequestTimeoutError):
                answer.result(0)
        else:
            assert answer.result(0) == winner and answer.exception(0) is None


def test_running_state_and_a_settled_answer_cannot_be_taken_into_a_batch():
    fresh = Claimed()
    assert not fresh.running() and not fresh.done() and not fresh.cancelled()
    assert fresh.set_running_or_notify_cancel() is True and fresh.running()
    fresh.settle("value")          # stored, its waiter not woken yet
    assert not fresh.running() and fresh.done()
    wake_answers([fresh])
    assert fresh.result(0) == "value"

    timed_out = Claimed()
    timed_out.set_exception(RequestTimeoutError(0.1, "waiting in the queue"))
    with pytest.raises(RuntimeError, match="already set"):
        timed_out.set_running_or_notify_cancel()
    assert not timed_out.running()
    with pytest.raises(TimeoutError):
        Claimed().result(0.01)     # nobody settles it: the caller's own timeout


def test_the_threads_skip_a_blocking_request_that_failed_while_queued(emulated):
    emulated("1x1")
    model = neuronmp.trace(lambda x: x * 2, torch.zeros(4, 3))
    with BatchingServer(model, 4, 1000, warmup=False) as server:
        failed = server._request((torch.zeros(3),), None, Claimed(), None)[0]
        live = server._request((torch.zeros(3),), None, Claimed(), None)[0]
        future = server._request((torch.zeros(3),), None, Answer(), None)[0]
        queue = server._threads.queue
        with queue.lock:
            for req in (failed, live, future):
                queue.add(req)
        failed.future.set_exception(RequestTimeoutError(0.1, "waiting in the queue"))
        with queue.lock:
            assert queue.take(4, start_future) == [live, future]
        assert live.future.running() and future.future.running()


@pytest.fixture
def slow_model(emulated):
    """One core; device time: a request outlasts what the test does meanwhile."""
    emulated("1x1")
    return neuronmp.trace(lambda x: x * 2 + 1, torch.zeros(8, 3), device_time=300_000)


def _sample(k):
    return torch.full((3,), float(k))


def test_a_partial_batch_waits_for_the_answered_caller_and_goes_when_it_is_back(slow_model):
    # a minute of delay: only the caller's return can send the held batch in time
    with BatchingServer(slow_model, 8, 60_000, warmup=False) as server:
        first = server.submit(_sample(0))            # an idle server: straight to the core
        queued = [server.submit(_sample(k)) for k in (1, 2, 3)]
        assert not first.done(), "the first request must still run for this test to mean much"
        assert first.result(timeout=30).tolist() == [1.0] * 3
        stats = server.stats()
        # its answer did not send the three alone: they wait for the caller answered
        assert (stats["batches"], stats["running"], stats["queued"]) == (1, 0, 3), stats
        back = server.submit(_sample(4))             # the caller is back: all four go
        for k, fut in enumerate(queued + [back], 1):
            assert fut.result(timeout=30).tolist() == [2.0 * k + 1] * 3
        stats = server.stats()
    assert stats["batch_sizes"] == {1: 1, 4: 1} and stats["direct"] == 1, stats
    assert stats["by_path"]["threads"] == {"submitted": 5, "batches": 2, "rows": 5}


def test_a_held_batch_goes_at_its_delay_when_the_caller_does_not_come_back(slow_model):
    with BatchingServer(slow_model, 8, 1_000, warmup=False) as server:
        first = server.submit(_sample(0))
        queued = [server.submit(_sample(k)) for k in (1, 2)]
        assert not first.done(), "the first request must still run for this test to mean much"
        first.result(timeout=30)
        stats = server.stats()
        assert (stats["batches"], stats["running"], stats["queued"]) == (1, 0, 2), stats
        for k, fut in enumerate(queued, 1):          # the clock sends them, as they are
            assert fut.result(timeout=30).tolist() == [2.0 * k + 1] * 3
        stats = server.stats()
    assert stats["batch_sizes"] == {1: 1, 2: 1} and stats["direct"] == 1, stats


def test_a_lone_caller_goes_straight_to_the_core_on_every_call(emulated):
    emulated("1x1")
    model = neuronmp.trace(lambda x: x * 2 + 1, torch.zeros(4, 3))
    with BatchingServer(model, 4, 60_000, warmup=False) as server:
        for k in range(5):                           # its own answer holds nothing back
            assert server.infer(_sample(k)).tolist() == [2.0 * k + 1] * 3
        other = []                                   # nor does another caller's
        t = threading.Thread(target=lambda: other.append(server.infer(_sample(9))))
        t.start()
        t.join(30)
        assert other and other[0].tolist() == [19.0] * 3
        stats = server.stats()
    assert stats["direct"] == 6 and stats["batch_sizes"] == {1: 6}, stats
