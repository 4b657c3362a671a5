"""pool.answer: the one answer type (real threads, real futexes, real asyncio)."""
import asyncio
import concurrent.futures
import signal
import threading
import time
from concurrent.futures import CancelledError, InvalidStateError

import pytest

from neuronmp.pool import answer as answer_mod
from neuronmp.pool.answer import Answer, Helper, Pending, gather
from neuronmp.shm import _waits


def _later(delay, fn, *args):
    t = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)))
    t.start()
    return t


def test_result_waits_for_an_answer_set_by_another_thread():
    a = Answer()
    t = _later(0.05, a.set_result, 42)
    assert a.result() == 42 and a.done()
    t.join()


def test_bounded_wait_times_out_then_sees_the_answer():
    a = Answer()
    t0 = time.monotonic()
    assert a.wait_done(0.05) is False
    assert time.monotonic() - t0 >= 0.045
    with pytest.raises(TimeoutError):
        a.result(timeout=0.01)
    a.set_exception(ValueError("bad row"))
    assert a.wait_done(0) is True
    with pytest.raises(ValueError, match="bad row"):
        a.result()
    assert isinstance(a.exception(), ValueError)


def test_first_answer_wins():
    a = Answer()
    a.set_result(1)
    with pytest.raises(InvalidStateError):
        a.set_exception(TimeoutError())
    with pytest.raises(InvalidStateError):
        a.settle(2)
    assert a.result() == 1


def _settle_then_wake(answers) -> None:
    """Waiters asleep in result(): settling alone wakes none, one wake() answers all."""
    got = [None] * len(answers)

    def waiter(i):
        got[i] = answers[i].result()

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    time.sleep(0.05)  # most are asleep on their flag by now
    for i, a in enumerate(answers):
        a.settle(i * 10 + 1)   # non-zero: a woken waiter shows
    time.sleep(0.05)  # long enough for a woken waiter to store its value
    assert got == [None] * len(answers), "settling alone must not wake a sleeper"
    answer_mod.wake(answers)
    for t in threads:
        t.join(5)
    assert got == [i * 10 + 1 for i in range(len(answers))]


def test_settling_alone_wakes_nobody_and_one_wake_call_answers_every_waiter():
    _settle_then_wake([Answer() for _ in range(48)])


def test_it_is_a_future_for_wait_as_completed_callbacks_and_cancel():
    answers = [Answer() for _ in range(3)]
    seen = []
    answers[0].add_done_callback(lambda f: seen.append(f.result()))
    threads = [_later(0.02 * (i + 1), a.set_result, i) for i, a in enumerate(answers)]
    done, not_done = concurrent.futures.wait(answers, timeout=5)
    assert len(done) == 3 and not not_done
    assert sorted(f.result() for f in concurrent.futures.as_completed(answers)) == [0, 1, 2]
    assert seen == [0]
    for t in threads:
        t.join()
    pending = Answer()
    assert pending.cancel() and pending.cancelled()
    with pytest.raises(CancelledError):
        pending.result()
    assert pending.set_running_or_notify_cancel() is False
    running = Answer()
    assert running.set_running_or_notify_cancel() and not running.cancel()


def test_a_started_answer_is_running_refuses_cancel_and_reads_itself_in_its_callbacks():
    started = Answer(running=True)   # what the pool hands out: sent at once
    assert started.running() and not started.done() and not started.cancel()
    seen = []
    # a done-callback runs in the settling thread before the answer is marked settled:
    # reading the answer there must not wait for that mark
    started.add_done_callback(lambda f: seen.append((f.done(), f.result(0), f.exception(0))))
    started.set_result(7)
    assert seen == [(True, 7, None)]
    assert not started.running() and not started.cancelled() and started.result() == 7
    failed = Answer(running=True)
    failed.set_exception(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        failed.result(0)
    assert isinstance(failed.exception(0), ValueError)
    with pytest.raises(InvalidStateError):
        failed.set_result(1)
    done, _ = concurrent.futures.wait([started, failed], timeout=1)
    assert done == {started, failed}


def test_asyncio_awaits_it_without_blocking_the_loop():
    async def main():
        a = Answer()
        _later(0.05, a.set_result, "ok").join(0)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while not a.done():
                ticks += 1
                await asyncio.sleep(0.005)

        value, _ = await asyncio.gather(asyncio.wrap_future(a), ticker())
        return value, ticks

    value, ticks = asyncio.run(main())
    assert value == "ok" and ticks >= 3


def test_a_helper_runs_in_the_waiting_thread_and_watches_callbacks():
    class Producer(Helper):
        def __init__(self):
            self.waited_in, self.watched = [], 0

        def wait(self, answer, timeout):
            self.waited_in.append(threading.current_thread())
            answer.set_result("made by the waiter")

        def watch(self, answer):
            self.watched += 1

    producer = Producer()
    a = Answer(producer)
    assert a.result() == "made by the waiter"
    assert producer.waited_in == [threading.current_thread()]
    b = Answer(producer)
    b.add_done_callback(lambda f: None)
    assert producer.watched == 1


def test_gather_joins_in_order_and_fails_with_the_first_error_after_all_finish():
    parts = [Answer() for _ in range(3)]
    joined = gather(parts, lambda values: sum(values, []))
    for i, p in reversed(list(enumerate(parts))):
        p.set_result([i])
    assert joined.result(timeout=1) == [0, 1, 2]
    parts = [Answer() for _ in range(2)]
    joined = gather(parts, lambda values: values)
    parts[0].set_exception(KeyError("first"))
    assert not joined.done(), "the joined answer waits for every part"
    parts[1].set_result(1)
    with pytest.raises(KeyError, match="first"):
        joined.result(timeout=1)


def test_a_signal_interrupts_a_waiting_main_thread():
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            Answer().result()
        assert time.monotonic() - t0 < 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_flag_must_be_a_bytearray():
    with pytest.raises(TypeError, match="bytearray of at least 4 bytes"):
        _waits.flag_wait(b"\0\0\0\0", 0.0)
    with pytest.raises(TypeError, match="bytearray of at least 4 bytes"):
        _waits.flags_set([bytearray(2)])


# -- Pending: a blocking call's answer ------------------------------------------------


def test_pending_waits_times_out_and_first_setting_wins():
    p = Pending()
    assert not p.done() and not p.cancelled()
    assert p.wait_done(0.02) is False
    with pytest.raises(TimeoutError):
        p.result(timeout=0.01)
    t = _later(0.05, p.set_result, [7])
    assert p.result() == [7] and p.exception() is None
    t.join()
    with pytest.raises(InvalidStateError):
        p.set_exception(TimeoutError())
    with pytest.raises(InvalidStateError):
        p.settle(1)
    assert p.result() == [7]
    failed = Pending()
    failed.set_exception(ValueError("bad row"))
    with pytest.raises(ValueError, match="bad row"):
        failed.result()
    assert isinstance(failed.exception(0), ValueError)


def test_pending_is_no_future_and_settling_alone_wakes_nobody():
    assert not isinstance(Pending(), concurrent.futures.Future)
    assert not hasattr(Pending(), "add_done_callback")   # a Future user gets an Answer
    _settle_then_wake([Pending() for _ in range(8)])


def test_pending_lets_its_helper_produce_it_in_the_waiting_thread():
    class Producer(Helper):
        def __init__(self):
            self.waited_in = []

        def wait(self, answer, timeout):
            self.waited_in.append((threading.current_thread(), timeout))
            answer.set_result("made by the waiter")

    producer = Producer()
    assert Pending(producer).result(timeout=5) == "made by the waiter"
    assert producer.waited_in[0][0] is threading.current_thread()
    assert 0 < producer.waited_in[0][1] <= 5


def test_gather_of_pendings_joins_in_the_waiting_thread_after_every_part():
    parts = [Pending() for _ in range(3)]
    joined = gather(parts, lambda values: sum(values, []), future=False)
    assert isinstance(joined, Pending)
    threads = [_later(0.01 * (3 - i), p.set_result, [i]) for i, p in enumerate(parts)]
    assert joined.result(timeout=5) == [0, 1, 2]
    for t in threads:
        t.join()
    parts = [Pending() for _ in range(2)]
    joined = gather(parts, lambda values: values, future=False)
    parts[0].set_exception(KeyError("first"))
    assert joined.wait_done(0.02) is False, "the joined answer waits for every part"
    t = _later(0.02, parts[1].set_result, 1)
    with pytest.raises(KeyError, match="first"):
        joined.result(timeout=5)
    t.join()
    assert parts[1].done()
