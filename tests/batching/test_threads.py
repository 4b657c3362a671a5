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
