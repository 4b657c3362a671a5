"""The answer slot of a blocking call: the part of a Future a waiter needs, on one flag.

A ``concurrent.futures.Future`` builds a condition variable per request and
notifies through it; on the synchronous paths (``Pool.run``, the batching
server's ``infer``) that was the biggest Python cost per request.  A slot is
one futex flag (``ipc._sync``): its waiter sleeps on it with the GIL released.

    answering thread                          waiting thread
    settle(slot, value)  ── state, value ──▶  result(): flag_wait(flag)
    wake([slots])        ── flags_set ─────▶      (GIL released while asleep)

Settling only stores; the futex wake-ups are made by :func:`wake`, for many
slots in one call and without the GIL, so that a batch of answers does not
serialise its wake-up system calls on the GIL (the batching server answers a
whole batch at once).  ``set_result`` / ``set_exception`` settle and wake one.

Setting is "first one wins" (a late timeout and a late answer may race) and
raises ``InvalidStateError`` for the loser, like a Future.
"""
from __future__ import annotations

import threading
from concurrent.futures import InvalidStateError
from typing import Any, Iterable, Optional

from ..ipc import _sync

_PENDING, _RUNNING, _OK, _ERROR = range(4)
OK = _OK  # the state ``settle`` takes for a result
_SETTLE = threading.Lock()  # one for all slots: held for two stores
_flag_wait, _flags_set = _sync.flag_wait, _sync.flags_set


class Slot:
    """One pending answer; ``result()`` blocks until it is set."""

    __slots__ = ("_flag", "_state", "_value")

    def __init__(self):
        self._flag = bytearray(4)
        self._state = _PENDING
        self._value: Any = None

    def set_running_or_notify_cancel(self) -> bool:
        self._state = _RUNNING
        return True  # nobody can cancel a blocking call

    def running(self) -> bool:
        return self._state == _RUNNING

    def done(self) -> bool:
        return self._state >= _OK

    def set_result(self, value: Any) -> None:
        self.settle(_OK, value)
        _flags_set((self._flag,))

    def set_exception(self, exc: BaseException) -> None:
        self.settle(_ERROR, exc)
        _flags_set((self._flag,))

    def settle(self, state: int, value: Any) -> None:
        """Store the answer without waking the waiter (see :func:`wake`)."""
        _SETTLE.acquire()
        if self._state >= _OK:
            _SETTLE.release()
            raise InvalidStateError("the answer is already set")
        self._value, self._state = value, state
        _SETTLE.release()

    def wait_done(self, timeout: Optional[float] = None) -> bool:
        """Wait until the answer is set (at most ``timeout`` seconds); whether it is."""
        return _flag_wait(self._flag, -1.0 if timeout is None else float(timeout))

    def result(self) -> Any:
        """The answer, or raise its exception (blocks until set)."""
        _flag_wait(self._flag, -1.0)
        if self._state == _OK:
            return self._value
        raise self._value


def wake(slots: Iterable[Slot]) -> None:
    """Wake the waiters of settled slots: one call, the GIL released."""
    _flags_set([s._flag for s in slots])
