"""The batching queue's lock: reentrant, and taken only by a thread that holds the GIL.

A section of code that holds a BatchQueue's lock is a few microseconds of Python,
which keeps the GIL as a rule.  Yet once one holder loses the GIL inside it (a forced
switch, a wake-up), a plain lock convoys under many threads:

    thread A holds the lock and loses the GIL for a moment
    thread B, with the GIL, finds the lock taken and sleeps on it (GIL let go)
    A releases the lock: the kernel hands it to B, which now owns it while it
      queues for the GIL behind every runnable caller
    every caller that gets the GIL meanwhile finds the lock taken and sleeps on it;
      the next release hands it to one of them, asleep, and so on

Measured on the threads' path with 256 callers on 8 device-time cores, a plain
RLock was found taken by about one acquisition in every request, each a sleep
and two waits for the GIL; this lock by 3 in 1,000 (docs/performance.md, "The
batching server").

So a thread that finds it taken never sleeps on it: it lets the GIL go for a short
sleep and tries again, and takes the lock only in a moment when it holds the GIL,
as the owner, which holds the GIL too, has let it go by then.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Tuple

__all__ = ["QueueLock"]

#: how long a thread that found the lock taken sleeps before it looks again
#: (the owner needs the GIL only for the rest of a short section)
POLL_S = 20e-6


class QueueLock:
    """A reentrant lock (``threading.RLock``'s interface, usable by a
    ``threading.Condition``) whose waiters poll instead of sleeping on it."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while not self._lock.acquire(False):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    __enter__ = acquire

    def release(self) -> None:
        self._lock.release()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    # -- what threading.Condition uses to wait with the lock let go --------------------

    def _release_save(self) -> Tuple[int, Any]:
        return self._lock._release_save()

    def _acquire_restore(self, state: Tuple[int, Any]) -> None:
        # taken again as acquire() takes it, then to the depth it had
        self.acquire()
        for _ in range(state[0] - 1):
            self._lock.acquire(False)

    def _is_owned(self) -> bool:
        return self._lock._is_owned()
