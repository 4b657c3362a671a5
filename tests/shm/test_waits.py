"""The tickets and the wake-up of many waiters in shm._waits, between real processes
on a shared mapping (the collectives' arrivals are built on them)."""
from __future__ import annotations

import mmap
import multiprocessing
import time

import pytest

from neuronmp.shm import _waits

_CTX = multiprocessing.get_context("fork")


def _draw(mm, n: int, q) -> None:
    q.put([_waits.fetch_add(mm, 8, 1) for _ in range(n)])


def test_tickets_drawn_at_once_by_many_processes_are_each_drawn_once():
    mm = mmap.mmap(-1, 4096)
    q, n, procs = _CTX.Queue(), 20000, 4
    workers = [_CTX.Process(target=_draw, args=(mm, n, q)) for _ in range(procs)]
    for w in workers:
        w.start()
    drawn = [t for _ in workers for t in q.get(timeout=120)]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    # no two processes drew the same ticket, none was lost
    assert sorted(drawn) == list(range(n * procs))
    assert _waits.load(mm, 8) == n * procs


def _sleep_on(mm, flag: int, q) -> None:
    # no spin: straight to the futex, behind its own flag among several
    t0 = time.monotonic()
    v = _waits.wait(mm, 64, 0, flag, 0, 0.0, 30.0, 0.0)
    q.put((v, time.monotonic() - t0))


def test_a_publish_wakes_a_sleeper_whose_flag_is_one_of_several():
    mm = mmap.mmap(-1, 4096)
    q = _CTX.Queue()
    sleeper = _CTX.Process(target=_sleep_on, args=(mm, 128 + 4 * 2, q))
    sleeper.start()
    deadline = time.monotonic() + 30
    while mm[136] == 0:   # its flag raised: it sleeps (or is about to)
        assert time.monotonic() < deadline, "the waiter never raised its flag"
        time.sleep(0.001)
    assert _waits.publish_any(mm, 64, 7, 128, 4) is True
    v, waited = q.get(timeout=30)
    sleeper.join(timeout=30)
    assert v == 7 and waited < 20   # woken, not timed out
    # nobody sleeps: no wake-up call
    assert _waits.publish_any(mm, 64, 8, 128, 4) is False
    assert _waits.load(mm, 64) == 8


def test_publish_any_refuses_flags_outside_the_mapping_and_a_negative_count():
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(IndexError, match="outside the mapping of 4096 bytes"):
        _waits.publish_any(mm, 64, 1, 4088, 4)
    with pytest.raises(ValueError, match="nflags must be >= 0, not -1"):
        _waits.publish_any(mm, 64, 1, 128, -1)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        _waits.fetch_add(mm, 4, 1)
