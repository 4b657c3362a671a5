"""Which owners of shared files are alive, as the kernel keeps it (fail closed).

A process that creates files in a shared directory (the shared-memory segments
of ``<runtime dir>/shm``) first locks a file of its own there, and keeps it
locked for as long as it owns files there:

    <dir>/nmp-<pid>-<start>.live          flock'ed by process (pid, start) while it lives
    <dir>/nmp-<pid>-<start>-<16 hex>      the files that process owns (segments)

    hold(dir)            before creating a file: make and lock our .live file
    state(owner, dir)    ALIVE | DEAD | UNKNOWN
    sweep(dir)           unlink what DEAD owners left, their .live file last
    release()            drop our .live files where we own nothing any more
    release(dying=True)  at exit: our files, then our .live files

A flock is dropped by the kernel when its holder dies, however it dies, and is
seen by every process sharing the file, whatever its PID namespace.  /proc is
not: a process in another PID namespace (a container sharing the runtime
directory) or behind ``hidepid`` looks dead there.  So only a .live file that
can be locked proves its owner dead; a missing one proves nothing (UNKNOWN),
unless /proc shows the owner running (ALIVE).  Nothing but DEAD is ever deleted.

An owner removes its files first and its .live file last (and a sweeper does
the same), so files never outlive their .live file.  Lock descriptors are
close-on-exec, and a forked child closes its copies without unlocking (they are
the parent's).  Imports no torch.
"""
from __future__ import annotations

import atexit
import os
import re
import threading
import time
from typing import Dict, List, Optional

from . import procid
from .flock import Flock

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"

_OWNED = re.compile(r"^nmp-(\d+)-(\d+)(?:-[0-9a-f]{16}|\.live)$")
_SUFFIX = ".live"
_LOCK_WAIT = 2.0  # a sweeper holds a dead namesake's lock for a few unlinks at most

_lock = threading.Lock()
_held: Dict[str, Flock] = {}  # real path of a directory -> our lock there


def prefix(owner: procid.ProcId) -> str:
    """The name prefix of every file ``owner`` owns (``nmp-<pid>-<start>``)."""
    return f"nmp-{owner.pid}-{owner.start}"


def live_path(owner: procid.ProcId, directory: str) -> str:
    return os.path.join(directory, prefix(owner) + _SUFFIX)


def owner_of(name: str) -> Optional[procid.ProcId]:
    """The (pid, start) a file name of this scheme carries, or None for a foreign file."""
    m = _OWNED.match(name)
    return procid.ProcId(int(m.group(1)), int(m.group(2))) if m else None


def hold(directory: str) -> None:
    """Make sure this process holds its .live file in ``directory`` (idempotent)."""
    key = os.path.realpath(directory)
    if key in _held:
        return
    with _lock:
        if key not in _held:
            _prune()
            _held[key] = _make(directory)


def _make(directory: str) -> Flock:
    path = live_path(procid.current(), directory)
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        lk = Flock.acquire(path, max(0.0, deadline - time.monotonic()))
        if lk is None:
            raise TimeoutError(f"{path} stayed locked by another process for "
                               f"{_LOCK_WAIT:g} s; it names this process")
        if lk.linked():
            return lk
        lk.release()  # a sweeper removed a dead namesake's file between our open and lock


def _prune() -> None:
    """Forget locks whose file is gone (its directory was removed under us)."""
    for key, lk in list(_held.items()):
        if not lk.linked():
            lk.release()
            del _held[key]


def state(owner: procid.ProcId, directory: str) -> str:
    """ALIVE, DEAD or UNKNOWN: see the module docstring.  Only DEAD may delete."""
    lk = _try_lock(owner, directory)
    if isinstance(lk, Flock):
        lk.release()
        return DEAD
    return lk


def _try_lock(owner: procid.ProcId, directory: str):
    """The owner's .live lock if it can be taken (DEAD), else ALIVE or UNKNOWN."""
    try:
        lk = Flock.try_acquire(live_path(owner, directory), create=False)
    except FileNotFoundError:
        return ALIVE if owner.alive() else UNKNOWN
    except OSError:
        return UNKNOWN
    if lk is None:
        return ALIVE
    if not lk.linked():  # another sweeper finished with it meanwhile
        lk.release()
        return UNKNOWN
    return lk


def sweep(directory: str) -> List[str]:
    """Unlink every file of this scheme whose owner is DEAD; the names removed."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    by_owner: Dict[procid.ProcId, List[str]] = {}
    for name in names:
        owner = owner_of(name)
        if owner is not None:
            by_owner.setdefault(owner, []).append(name)
    removed: List[str] = []
    for owner, owned in by_owner.items():
        lk = _try_lock(owner, directory)
        if not isinstance(lk, Flock):
            continue
        try:
            for name in sorted(owned, key=lambda n: n.endswith(_SUFFIX)):  # .live last
                _unlink(os.path.join(directory, name))
                removed.append(name)
        finally:
            lk.release()
    return removed


def owns_files(directory: str, owner: Optional[procid.ProcId] = None) -> bool:
    """Whether ``owner`` (default: this process) has files other than its .live there."""
    start = prefix(owner or procid.current()) + "-"
    try:
        return any(n.startswith(start) for n in os.listdir(directory))
    except FileNotFoundError:
        return False


def release(dying: bool = False) -> None:
    """Unlink and unlock our .live files in every directory where we own nothing now.

    Called at runtime shutdown, and by a worker as it ends.  Where files of ours
    remain, the lock stays (they are in use, or nobody could tell they are ours
    to sweep).  ``dying`` (at exit, on SIGTERM): this process will never use its
    files again, and nobody else may (a peer keeps its mapping), so they go first,
    as the next sweep would remove them.
    """
    with _lock:
        for key, lk in list(_held.items()):
            if dying:
                _remove_own(key)
            elif owns_files(key):
                continue
            del _held[key]
            if lk.linked():
                _unlink(lk.path)
            lk.release()


def _remove_own(directory: str) -> None:
    start = prefix(procid.current()) + "-"
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(start):
            _unlink(os.path.join(directory, name))


def holding() -> List[str]:
    """The directories where this process holds its .live file (for tests and tools)."""
    return sorted(_held)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _forget_in_child() -> None:
    # the parent's locks: closing our copies keeps them the parent's (never LOCK_UN)
    global _lock
    _lock = threading.Lock()
    for lk in _held.values():
        lk.forget()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(release, dying=True)  # a process with segments and no runtime
