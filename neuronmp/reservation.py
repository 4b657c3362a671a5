"""Host-wide exclusive ownership of NeuronCores (layer 3 of neuronmp).

One lock file per global core, in the per-user runtime directory:

    <runtime dir>/cores/nc<N>.lock     flock'ed (via filelock) by the owner, for its life
    <runtime dir>/cores/nc<N>.holder   JSON: pid, start time, host, command, cores
    <runtime dir>/cores/alloc.lock     held only while a process picks its cores

    reserve(request) --> [alloc.lock] lock nc<a>..nc<b> ascending, non-blocking,
                         all or nothing; write each .holder (tmp + rename) [unlock]
                     --> Reservation(cores)
    release()        --> remove each .holder, then unlock
    tidy()           --> [alloc.lock] all core locks free and no segment left:
                         remove the directory (the last process out)

The kernel drops a flock when the last descriptor of its open file description
closes, so an owner that dies in any way (even SIGKILL) frees its cores at
once; a ``.holder`` it leaves behind is stale and recognised as such because
its (pid, start time) no longer names a live process.  Lock descriptors are
close-on-exec, so an exec'd child never keeps a reservation; a forked child
must close its inherited copies (``Reservation.forget_after_fork``) without
unlocking, which would unlock the parent's.

Readers (:func:`core_states`, used by ``neuronmp-ls`` and by refusal messages)
never take a lock: they combine the holder records with ``/proc/locks``, so
they are safe while other processes reserve and release.

Imports no torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import socket
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import filelock

from . import paths, procid
from .errors import ConfigError, CoreUnavailableError
from .topology import Topology
from .visibility import Request, candidate_blocks

ENV_RESERVE_TIMEOUT = "NEURONMP_RESERVE_TIMEOUT"
RESERVE_TIMEOUT_ACCEPTED = "a number of seconds >= 0 (0, the default, refuses at once)"

#: Full rescans allowed when every block failed though the lock-free view shows one
#: free: something held a lock for a moment (a probe, or a racer that backs out).
_RACE_RETRIES = 20
_POLL_INTERVAL = 0.05
_MUTEX_TIMEOUT = 10.0  # normally held for microseconds; a stuck holder is a bug


# -- where things live ----------------------------------------------------------


def cores_dir(base: Optional[str] = None, create: bool = True) -> str:
    """The checked directory holding the core locks (``<runtime dir>/cores``)."""
    if create:
        return paths.subdir("cores", base or paths.runtime_dir())
    root = base or os.environ.get(paths.ENV_RUNTIME_DIR) or paths.default_runtime_dir()
    path = os.path.join(root, "cores")
    if os.path.exists(path):  # a missing one (never made, or tidied away) holds nothing
        paths.check_dir(root)
        paths.check_dir(path)
    return path


def lock_path(directory: str, core: int) -> str:
    return os.path.join(directory, f"nc{core}.lock")


def holder_path(directory: str, core: int) -> str:
    return os.path.join(directory, f"nc{core}.holder")


# -- holder records --------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds a core: a process identity plus what to show a person."""

    pid: int
    start: Optional[int]
    host: str
    command: str
    cores: Tuple[int, ...] = ()

    def alive(self) -> bool:
        return self.start is not None and procid.ProcId(self.pid, self.start).alive()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cores"] = list(self.cores)
        return d


def _this_holder(cores: Sequence[int]) -> Holder:
    me = procid.current()
    command = " ".join(procid.cmdline(me.pid).split())  # one line for tables and messages
    return Holder(me.pid, me.start, socket.gethostname(), command, tuple(cores))


def _write_holder(directory: str, core: int, holder: Holder) -> None:
    # tmp + rename: a reader sees the old record or the whole new one, never a torn one
    final = holder_path(directory, core)
    tmp = f"{final}.{holder.pid}.tmp"
    with open(tmp, "w") as f:
        json.dump(holder.to_dict(), f)
    os.replace(tmp, final)


def read_holder(directory: str, core: int) -> Optional[Holder]:
    """The holder record of ``core`` as written (alive or not), or None."""
    try:
        with open(holder_path(directory, core)) as f:
            d = json.load(f)
        return Holder(int(d["pid"]), d.get("start"), str(d.get("host", "")),
                      str(d.get("command", "")), tuple(d.get("cores", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_holder(directory: str, core: int, pid: int) -> None:
    # only our own record: after a crash another process may already have replaced it
    rec = read_holder(directory, core)
    if rec is not None and rec.pid == pid:
        try:
            os.unlink(holder_path(directory, core))
        except FileNotFoundError:
            pass


# -- the lock-free view ----------------------------------------------------------


@dataclass(frozen=True)
class CoreState:
    """One core as seen without locking: held or not, and by whom when known."""

    core: int
    held: bool
    holder: Optional[Holder]

    def to_dict(self) -> dict:
        return {"core": self.core, "held": self.held,
                "holder": self.holder.to_dict() if self.holder else None}


def _proc_locks() -> Optional[Dict[Tuple[int, int, int], int]]:
    """(major, minor, inode) -> pid of every flock on the host, or None if unreadable."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4912 00:1b:62 0 EOF"; blocked waiters carry a "->"
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            out[(int(major, 16), int(minor, 16), int(inode))] = int(parts[4])
        except ValueError:
            continue
    return out


def core_states(num_cores: int, base: Optional[str] = None) -> List[CoreState]:
    """Every core's state, read without taking any lock.

    A core is held when the kernel lists a flock on its lock file (``/proc/locks``;
    when that is unreadable, when its holder record names a live process).  The
    holder is the record when it names a live process, else the pid the kernel
    reports (a process still writing its record, or a forked child that kept the
    lock).
    """
    directory = cores_dir(base, create=False)
    if not os.path.isdir(directory):
        return [CoreState(c, False, None) for c in range(num_cores)]
    locks = _proc_locks()
    return [_core_state(directory, core, locks) for core in range(num_cores)]


def _core_state(directory: str, core: int, locks) -> CoreState:
    rec = read_holder(directory, core)
    live = rec if rec is not None and rec.alive() else None
    if locks is None:
        return CoreState(core, live is not None, live)
    try:
        st = os.stat(lock_path(directory, core))
    except FileNotFoundError:
        return CoreState(core, False, None)
    pid = locks.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    if pid is None:
        return CoreState(core, False, None)
    if live is None:
        # the kernel names whoever took the lock; if that process is gone, a child
        # that inherited the descriptor (without neuronmp's at-fork cleanup) keeps it
        command = " ".join(procid.cmdline(pid).split()) or (
            "exited; a process that inherited its lock descriptor keeps the core")
        live = Holder(pid, procid.start_time(pid), "", command, ())
    return CoreState(core, True, live)


# -- taking and giving back --------------------------------------------------------


class Reservation:
    """Cores this process holds exclusively until :meth:`release` (or its death)."""

    def __init__(self, directory: str, cores: Tuple[int, ...], locks: List[filelock.BaseFileLock],
                 holder: Holder):
        self.directory = directory
        self.cores = cores
        self.holder = holder
        self._locks = locks
        self._fds = [_fd_identity(lk) for lk in locks]
        self._pid = os.getpid()

    @property
    def active(self) -> bool:
        return bool(self._locks)

    def release(self) -> None:
        """Remove the holder records, then unlock.  Idempotent.

        In a forked child this only drops the inherited descriptors: the cores
        stay the parent's.
        """
        if os.getpid() != self._pid:
            self.forget_after_fork()
            return
        locks, self._locks = self._locks, []
        for core in self.cores if locks else ():
            _remove_holder(self.directory, core, self.holder.pid)
        for lk in reversed(locks):
            lk.release(force=True)

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited lock descriptors WITHOUT unlocking.

        ``flock(LOCK_UN)`` acts on the open file description the parent shares, so
        it would free the parent's cores; closing our descriptor only drops our
        reference.  Newer filelock versions already close them at fork; the
        identity check makes sure a descriptor number reused since is left alone.
        """
        for lk, (fd, ident) in zip(self._locks, self._fds):
            if fd is not None and _identity(fd) == ident:
                try:
                    os.close(fd)
                except OSError:
                    pass
            ctx = getattr(lk, "_context", None)
            if ctx is not None and getattr(ctx, "lock_file_fd", None) is not None:
                ctx.lock_file_fd = None  # so filelock's __del__ cannot unlock it
                ctx.lock_counter = 0
        self._locks = []
        self._fds = []

    def __repr__(self) -> str:
        state = "held" if self.active else "released"
        return f"Reservation(cores={self.cores}, {state})"


def _identity(fd: int) -> Optional[Tuple[int, int]]:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _fd_identity(lk) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    fd = getattr(getattr(lk, "_context", None), "lock_file_fd", None)
    return fd, (_identity(fd) if fd is not None else None)


def _try_lock(directory: str, core: int) -> Optional[filelock.BaseFileLock]:
    # thread_local=False: the descriptor must be visible to the at-fork handler and to
    # shutdown() whichever thread runs them
    lk = filelock.FileLock(lock_path(directory, core), thread_local=False)
    try:
        lk.acquire(timeout=0)
    except filelock.Timeout:
        return None
    return lk


def _try_block(directory: str, block: Sequence[int]):
    """Lock every core of ``block`` ascending; on the first busy one back out.

    Returns (locks, None) on success, else ([], the busy core).
    """
    taken = []
    for core in block:
        lk = _try_lock(directory, core)
        if lk is None:
            for t in reversed(taken):
                t.release(force=True)
            return [], core
        taken.append(lk)
    return taken, None


def _scan(directory: str, blocks: Sequence[Tuple[int, ...]]):
    """First block of ``blocks`` that could be locked whole: (block, locks) or None."""
    busy: Set[int] = set()
    for block in blocks:
        if busy.intersection(block):
            continue
        locks, failed = _try_block(directory, block)
        if failed is None:
            return block, locks
        busy.add(failed)
    return None


def reserve(request: Request, topology: Topology, timeout: float = 0.0,
            base: Optional[str] = None) -> Reservation:
    """Reserve the cores ``request`` asks for, host-wide, or raise CoreUnavailableError.

    Explicit cores are taken exactly; a count takes the first free contiguous
    block; neither takes every core.  ``timeout`` seconds (default 0) are spent
    waiting for cores to be released before refusing.
    """
    if timeout < 0 or not math.isfinite(timeout):
        raise ConfigError("timeout", str(timeout), "it must be a finite number >= 0",
                          RESERVE_TIMEOUT_ACCEPTED)
    blocks = candidate_blocks(request, topology.num_cores)
    deadline = time.monotonic() + timeout
    races = 0
    while True:
        with _allocation_mutex(base, _requested(request, blocks)) as directory:
            found = _scan(directory, blocks)
            if found is not None:
                return _commit(directory, *found)
            states = core_states(topology.num_cores, base=os.path.dirname(directory))
        free = {s.core for s in states if not s.held}
        if any(free.issuperset(b) for b in blocks) and races < _RACE_RETRIES:
            # the lock-free view says a block is free: what stopped us was a momentary
            # hold (a process probing a lock), so look again right away
            races += 1
            time.sleep(random.uniform(0.0005, 0.005))
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _refusal(request, blocks, states)
        time.sleep(min(remaining, random.uniform(0.5, 1.5) * _POLL_INTERVAL))
        races = 0


@contextlib.contextmanager
def _allocation_mutex(base: Optional[str], requested):
    """Serialise scans between reserving processes.

    Without it, two processes scanning for blocks at once hold parts of blocks
    for a moment and push each other off the first free block, fragmenting the
    host (five NUM_CORES=3 racers on 16 cores could leave no room for the fifth).
    It is held for microseconds and, being a flock, dies with its holder.
    """
    while True:
        directory = cores_dir(base)
        mutex = filelock.FileLock(os.path.join(directory, "alloc.lock"), thread_local=False)
        try:
            mutex.acquire(timeout=_MUTEX_TIMEOUT, poll_interval=0.001)
        except filelock.Timeout:
            raise CoreUnavailableError(
                requested, 0, (), f"another process kept {mutex.lock_file} locked for "
                f"{_MUTEX_TIMEOUT:g} s while reserving (see neuronmp-ls)") from None
        except FileNotFoundError:
            continue  # the last process out removed the directory meanwhile (tidy)
        if _still_linked(mutex):
            break
        mutex.release(force=True)  # we locked a file tidy() had already unlinked
    try:
        yield directory
    finally:
        mutex.release(force=True)


def _still_linked(lk) -> bool:
    """Whether the locked descriptor is still the file at the lock's path."""
    _, ident = _fd_identity(lk)
    try:
        st = os.stat(lk.lock_file)
    except FileNotFoundError:
        return False
    return ident == (st.st_dev, st.st_ino)


def tidy(base: Optional[str] = None) -> bool:
    """Remove the runtime directory if nothing in it is in use; True when removed.

    The last process to give its cores back leaves no trace in /dev/shm.  Safe
    against reservers: it holds ``alloc.lock`` (every core lock is taken under
    it), removes only when every core lock is free and no shared-memory segment
    remains (those are the worker pools'; a dead pool's are swept at the next
    start-up), and unlinks ``alloc.lock`` last while still holding it: a
    reserver that was waiting for it sees it was unlinked and starts over.
    """
    directory = cores_dir(base, create=False)
    root = os.path.dirname(directory)
    mutex = filelock.FileLock(os.path.join(directory, "alloc.lock"), thread_local=False)
    try:
        mutex.acquire(timeout=0)
    except (filelock.Timeout, FileNotFoundError):
        return False  # someone is reserving (or it is gone already)
    try:
        shm = os.path.join(root, "shm")
        if not _still_linked(mutex) or (os.path.isdir(shm) and os.listdir(shm)):
            return False
        probes = _probe_all_free(directory)
        if probes is None:
            return False
        try:
            for name in os.listdir(directory):
                if name != "alloc.lock":
                    os.unlink(os.path.join(directory, name))
            os.unlink(os.path.join(directory, "alloc.lock"))
        finally:
            for fd in probes:
                os.close(fd)
    finally:
        mutex.release(force=True)
    for path in (directory, os.path.join(root, "shm"), root):
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty (another user of the directory) or already gone
    return not os.path.exists(root)


def _probe_all_free(directory: str) -> Optional[List[int]]:
    """Lock every core lock file (all free), or None if any is held."""
    fds: List[int] = []
    for name in os.listdir(directory):
        if not name.endswith(".lock") or name == "alloc.lock":
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CLOEXEC)
        fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            for f in fds:
                os.close(f)
            return None
    return fds


def _commit(directory: str, block: Tuple[int, ...], locks) -> Reservation:
    holder = _this_holder(block)
    try:
        for core in block:
            _write_holder(directory, core, holder)
    except BaseException:
        for core in block:
            _remove_holder(directory, core, holder.pid)
        for lk in reversed(locks):
            lk.release(force=True)
        raise
    return Reservation(directory, tuple(block), locks, holder)


def _refusal(request: Request, blocks, states: List[CoreState]) -> CoreUnavailableError:
    available = sum(1 for s in states if not s.held)
    requested = _requested(request, blocks)
    if isinstance(requested, int):
        in_way = [s for s in states if s.held]  # every held core is in the way of some block
    else:
        in_way = [s for s in states if s.held and s.core in requested]
    holders = [(s.core, s.holder.pid if s.holder else 0,
                s.holder.command if s.holder else "unknown") for s in in_way]
    detail = "" if in_way else "cores were changing hands too fast; try again"
    return CoreUnavailableError(requested, available, holders, detail)


def _requested(request: Request, blocks):
    """What the refusal says was asked for: a count, or the explicit cores."""
    return request.count if request.count is not None else tuple(blocks[0])


def reserve_timeout_from_env(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds to wait for busy cores, from ``NEURONMP_RESERVE_TIMEOUT`` (default 0)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_RESERVE_TIMEOUT)
    if raw is None or not raw.strip():
        return 0.0
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(ENV_RESERVE_TIMEOUT, raw, "it is not a number",
                          RESERVE_TIMEOUT_ACCEPTED) from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(ENV_RESERVE_TIMEOUT, raw, "it must be a finite number >= 0",
                          RESERVE_TIMEOUT_ACCEPTED)
    return value
