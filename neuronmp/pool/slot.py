"""The answer slot of a blocking call: the part of a Future a waiter needs, on one lock.

A ``concurrent.futures.Future`` builds a condition variable per request and
notifies through it; on the synchronous paths (``Pool.run``, the batching
server's ``infer``) that was the biggest Python cost per request.  A slot is
one lock, held from creation until the answer is in: a waiter that is not
reading the answer itself blocks on the lock.

Setting is "first one wins" (a late timeout and a late answer may race) and
raises ``InvalidStateError`` for the loser, like a Future.
"""
from __future__ import annotations

import threading
from concurrent.futures import InvalidStateError
from typing import Any, Optional

_PENDING, _RUNNING, _OK, _ERROR = range(4)
_SETTLE = threading.Lock()  # one for all slots: held for two stores


class Slot:
    """One pending answer; ``result()`` blocks until it is set."""

    __slots__ = ("_lock", "_state", "_value")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
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
        self._settle(_OK, value)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_ERROR, exc)

    def _settle(self, state: int, value: Any) -> None:
        _SETTLE.acquire()
        if self._state >= _OK:
            _SETTLE.release()
            raise InvalidStateError("the answer is already set")
        self._value, self._state = value, state
        _SETTLE.release()
        self._lock.release()

    def wait_done(self, timeout: Optional[float] = None) -> bool:
        """Wait until the answer is set (at most ``timeout`` seconds); whether it is."""
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._lock.release()
            return True
        return False

    def result(self) -> Any:
        """The answer, or raise its exception (blocks until set)."""
        lock = self._lock
        lock.acquire()
        lock.release()
        if self._state == _OK:
            return self._value
        raise self._value
