"""The batching queue's lock: an RLock's behaviour, with waiters that poll."""
import threading
import time

import pytest

from neuronmp.batching.lock import QueueLock


def _held_elsewhere(lock):
    """A thread that holds ``lock`` until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            release.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    assert taken.wait(30)
    return t, release


def test_it_is_reentrant_and_released_only_at_its_depth():
    lock = QueueLock()
    with lock:
        with lock:
            assert lock._is_owned()
        assert lock._is_owned()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_waiter_gets_it_when_its_owner_lets_go():
    lock = QueueLock()
    t, release = _held_elsewhere(lock)
    assert lock.acquire(False) is False
    got = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []   # it waits while the owner holds it
    release.set()
    waiter.join(30)
    t.join(30)
    assert got == [True]


def test_a_timed_acquire_gives_up_at_its_timeout():
    lock = QueueLock()
    t, release = _held_elsewhere(lock)
    t0 = time.monotonic()
    assert lock.acquire(timeout=0.1) is False
    assert time.monotonic() - t0 >= 0.1
    release.set()
    t.join(30)
    assert lock.acquire(timeout=5) is True
    lock.release()


def test_a_condition_on_it_waits_and_restores_its_depth():
    lock = QueueLock()
    cv = threading.Condition(lock)
    ready = []

    def notifier():
        with cv:
            ready.append(True)
            cv.notify()
    with lock:
        with cv:   # depth 2: the wait lets go of both and takes both back
            threading.Thread(target=notifier).start()
            assert cv.wait_for(lambda: ready, timeout=30)
            assert lock._is_owned()
        assert lock._is_owned()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError):
        lock.release()
    with cv:   # no notify: the wait times out and still takes the lock back
        assert cv.wait(0.05) is False
        assert lock._is_owned()
