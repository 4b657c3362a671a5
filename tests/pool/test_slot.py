"""pool.slot: the one-flag answer slot of blocking calls (real threads, real futexes)."""
import signal
import threading
import time
from concurrent.futures import InvalidStateError

import pytest

from neuronmp.ipc import _sync
from neuronmp.pool import slot as slot_mod
from neuronmp.pool.slot import Slot


def _later(delay, fn, *args):
    t = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)))
    t.start()
    return t


def test_result_waits_for_an_answer_set_by_another_thread():
    s = Slot()
    t = _later(0.05, s.set_result, 42)
    assert s.result() == 42 and s.done()
    t.join()


def test_wait_done_times_out_then_sees_the_answer():
    s = Slot()
    t0 = time.monotonic()
    assert s.wait_done(0.05) is False
    assert time.monotonic() - t0 >= 0.045
    s.set_exception(ValueError("bad row"))
    assert s.wait_done(0) is True
    with pytest.raises(ValueError, match="bad row"):
        s.result()


def test_first_answer_wins():
    s = Slot()
    s.set_result(1)
    with pytest.raises(InvalidStateError):
        s.set_exception(TimeoutError())
    with pytest.raises(InvalidStateError):
        s.settle(slot_mod.OK, 2)
    assert s.result() == 1


def test_one_wake_call_answers_every_waiter_with_its_own_value():
    slots = [Slot() for _ in range(48)]
    got = [None] * len(slots)

    def waiter(i):
        got[i] = slots[i].result()

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(len(slots))]
    for t in threads:
        t.start()
    time.sleep(0.05)  # most are asleep on their flag by now
    for i, s in enumerate(slots):
        s.settle(slot_mod.OK, i * 10)
    assert not any(got), "settling alone must not wake anyone"
    slot_mod.wake(slots)
    for t in threads:
        t.join(5)
    assert got == [i * 10 for i in range(len(slots))]


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
            Slot().result()
        assert time.monotonic() - t0 < 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_flag_must_be_a_bytearray():
    with pytest.raises(TypeError, match="bytearray of at least 4 bytes"):
        _sync.flag_wait(b"\0\0\0\0", 0.0)
    with pytest.raises(TypeError, match="bytearray of at least 4 bytes"):
        _sync.flags_set([bytearray(2)])
