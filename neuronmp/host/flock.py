"""Exclusive whole-file locks with flock(2), one descriptor per lock.

Core reservations rest on what the kernel guarantees for flock, and this
module keeps exactly those guarantees (tests/host/test_flock.py proves each):

  * a flock belongs to the open file description, not to the process.  A
    forked child shares it: closing the child's copy leaves the parent's lock
    alone, but ``LOCK_UN`` from the child would unlock it for both, so in a
    child :meth:`Flock.release` only closes (:meth:`Flock.forget`);
  * descriptors are opened ``O_CLOEXEC``: an exec'd program never inherits a
    lock, whatever ``close_fds`` says;
  * the lock goes when the last descriptor of the description closes, so a
    holder that dies in any way, SIGKILL included, frees it at once.

    Flock.try_acquire(path) -> Flock | None       never waits
    Flock.acquire(path, timeout) -> Flock | None  polls until the deadline
    lock.release()                                unlock + close (child: close)
    lock.forget()                                 close only
    lock.linked()                                 still the file at its path?

Written in-house rather than on a third-party lock library: what matters here
(the descriptor's identity, close-on-exec, fork behaviour) is private state in
those libraries, free to change in any release.
"""
from __future__ import annotations

import fcntl
import os
import time
from typing import Optional, Tuple

_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW


class Flock:
    """One exclusive flock held through one close-on-exec descriptor."""

    __slots__ = ("path", "_fd", "_ident", "_owner")

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: Optional[int] = fd
        self._ident = _identity(fd)
        self._owner = os.getpid()

    @classmethod
    def try_acquire(cls, path: str, create: bool = True) -> Optional[Flock]:
        """The lock on ``path`` if nobody holds it, else None (never waits).

        OSError from opening (a missing directory, or a missing file when not
        ``create``) propagates.
        """
        return cls.acquire(path, 0.0, create=create)

    @classmethod
    def acquire(cls, path: str, timeout: float, poll: float = 0.001,
                create: bool = True) -> Optional[Flock]:
        """The lock on ``path``, waiting up to ``timeout`` seconds; None if still held."""
        deadline = time.monotonic() + timeout
        fd = _open(path, create)
        try:
            while not _try(fd):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    os.close(fd)
                    return None
                time.sleep(min(poll, remaining))
        except BaseException:  # an interrupted wait must not leak the descriptor
            os.close(fd)
            raise
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"the lock on {self.path} is not held")
        return self._fd

    def linked(self) -> bool:
        """Whether the locked file is still the one at ``path`` (not unlinked or replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return self._fd is not None and self._ident == (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Unlock and close.  Idempotent.  In a forked child: close only (see forget)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() != self._owner:
            self._fd = fd
            self.forget()
            return
        try:
            # explicitly: a child forked without forget() still holds a copy
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def forget(self) -> None:
        """Close this descriptor WITHOUT unlocking: other copies keep the lock.

        For a forked child, whose copy shares the parent's lock.  A descriptor
        number that now names another file (closed and reused since the fork)
        is left alone.
        """
        fd, self._fd = self._fd, None
        if fd is not None and _identity(fd) == self._ident:
            os.close(fd)

    def __repr__(self) -> str:
        return f"Flock({self.path!r}, {'held' if self.held else 'released'})"


def _open(path: str, create: bool) -> int:
    flags = _OPEN_FLAGS | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


def _try(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _identity(fd: int) -> Optional[Tuple[int, int]]:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
