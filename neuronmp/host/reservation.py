"""Host-wide exclusive ownership of NeuronCores.

One lock file per global core, in the per-user runtime directory:

    <runtime dir>/cores/nc<N>.lock     flock'ed (flock.Flock) by the owner, for its life
    <runtime dir>/cores/nc<N>.holder   JSON: pid, start time, host, command, first, last
    <runtime dir>/cores/alloc.lock     held (filelock, with a timeout) only while a
                                       process picks its cores or sweeps records

    reserve(request) --> [alloc.lock] lock nc<a>..nc<b> ascending, non-blocking,
                         all or nothing; write each .holder (O_EXCL|O_NOFOLLOW
                         tmp, mode 0600, + rename) [unlock]
                     --> Reservation(cores)
    release()        --> remove each .holder, then unlock
    sweep_stale()    --> [alloc.lock] remove the .holder of every free core (a
                         process that died without releasing left it)
    tidy()           --> [alloc.lock] sweep dead owners' segments and stale
                         records; all core locks free and no segment left:
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

Cost: a core costs two small files and one descriptor, each written once per
reservation (no fsync: the directory is on tmpfs and dies with the host), so
taking all 4096 cores of ``64x64`` is a few thousand system calls
(tools/bench_reserve.py).  A process that needs more descriptors than its
soft RLIMIT_NOFILE allows has the limit raised toward the hard one.

Imports no torch.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import ConfigError, CoreUnavailableError, RuntimeDirError
from . import liveness, paths, procid, settings
from .flock import Flock
from .settings import RESERVE_TIMEOUT_ACCEPTED
from .topology import Topology
from .visibility import MAX_CORES, Request, candidate_blocks

#: Full rescans allowed when every block failed though the lock-free view shows one
#: free: something held a lock for a moment (a probe, or a racer that backs out).
_RACE_RETRIES = 20
_POLL_INTERVAL = 0.05
_MUTEX_TIMEOUT = 10.0  # normally held for milliseconds; a stuck holder is a bug
ALLOC_LOCK = "alloc.lock"
_SPARE_FDS = 64  # descriptors left free for everything else when the limit is raised


# -- where things live ----------------------------------------------------------


def cores_dir(base: Optional[str] = None, create: bool = True) -> Optional[str]:
    """The checked directory of the core locks (``<runtime dir>/cores``; see paths)."""
    return paths.cores_dir(base, create)


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
    tag: str = ""   # NEURON_PROCESS_TAG when the holder set one (monitors name it by that)

    def alive(self) -> bool:
        return self.start is not None and procid.ProcId(self.pid, self.start).alive()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cores"] = list(self.cores)
        return d


def _this_holder(cores: Sequence[int]) -> Holder:
    me = procid.current()
    command = " ".join(procid.cmdline(me.pid).split())  # one line for tables and messages
    return Holder(me.pid, me.start, socket.gethostname(), command, tuple(cores),
                  settings.get("process_tag") or "")


def _record(holder: Holder) -> bytes:
    """The holder record as stored: the cores as their first and last (they are
    contiguous), so a record stays small however many cores it covers."""
    d = {"pid": holder.pid, "start": holder.start, "host": holder.host,
         "command": holder.command, "first": holder.cores[0], "last": holder.cores[-1]}
    if holder.tag:
        d["tag"] = holder.tag
    return json.dumps(d).encode()


_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_holder(directory: str, core: int, record: bytes, pid: int) -> None:
    # tmp + rename: a reader sees the old record or the whole new one, never a torn
    # one.  O_EXCL|O_NOFOLLOW: whatever sits at the tmp name (a crashed namesake's
    # leftover, or a planted symlink) is removed, never written through.
    final = holder_path(directory, core)
    tmp = f"{final}.{pid}.tmp"
    try:
        fd = os.open(tmp, _TMP_FLAGS, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, _TMP_FLAGS, 0o600)
    try:
        try:
            os.write(fd, record)  # a few hundred bytes: one write on tmpfs
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        _unlink(tmp)
        raise


def _read_record(directory: str, core: int) -> Optional[bytes]:
    try:
        fd = os.open(holder_path(directory, core), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)


def _parse_holder(raw: Optional[bytes]) -> Optional[Holder]:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        if "first" in d:
            first, last = int(d["first"]), int(d["last"])
            if not 0 <= first <= last < MAX_CORES:
                return None
            cores = tuple(range(first, last + 1))
        else:  # a record written by an earlier neuronmp: the cores listed
            cores = tuple(int(c) for c in d.get("cores", ()))
        start = d.get("start")
        return Holder(int(d["pid"]), None if start is None else int(start),
                      str(d.get("host", "")), str(d.get("command", "")), cores,
                      str(d.get("tag", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_holder(directory: str, core: int) -> Optional[Holder]:
    """The holder record of ``core`` as written (alive or not), or None."""
    return _parse_holder(_read_record(directory, core))


def _remove_holder(directory: str, core: int, record: bytes) -> None:
    # only our own record: after a crash another process may already have replaced it
    if _read_record(directory, core) == record:
        _unlink(holder_path(directory, core))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
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
    directory = paths.cores_dir(base, create=False)
    if directory is None:
        return [CoreState(c, False, None) for c in range(num_cores)]
    locks = _proc_locks()
    seen: Dict[bytes, Optional[Holder]] = {}  # one reservation's records are identical
    return [_core_state(directory, core, locks, seen) for core in range(num_cores)]


def _live_holder(directory: str, core: int, seen: Dict[bytes, Optional[Holder]]):
    raw = _read_record(directory, core)
    if raw is None:
        return None
    if raw not in seen:
        rec = _parse_holder(raw)
        seen[raw] = rec if rec is not None and rec.alive() else None
    return seen[raw]


def _core_state(directory: str, core: int, locks, seen) -> CoreState:
    live = _live_holder(directory, core, seen)
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

    def __init__(self, directory: str, cores: Tuple[int, ...], locks: List[Flock],
                 holder: Holder, record: bytes):
        self.directory = directory
        self.cores = cores
        self.holder = holder
        self._locks = locks
        self._record = record
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
            _remove_holder(self.directory, core, self._record)
        for lk in reversed(locks):
            lk.release()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited lock descriptors WITHOUT unlocking.

        ``flock(LOCK_UN)`` acts on the open file description the parent shares, so
        it would free the parent's cores; closing our descriptor only drops our
        reference (:meth:`Flock.forget`).
        """
        locks, self._locks = self._locks, []
        for lk in locks:
            lk.forget()

    def __repr__(self) -> str:
        state = "held" if self.active else "released"
        return f"Reservation(cores={self.cores}, {state})"


def _try_block(directory: str, block: Sequence[int]):
    """Lock every core of ``block`` ascending; on the first busy one back out.

    Returns (locks, None) on success, else ([], the busy core).
    """
    taken: List[Flock] = []
    try:
        for core in block:
            lk = Flock.try_acquire(lock_path(directory, core))
            if lk is None:
                break
            taken.append(lk)
        else:
            return taken, None
    except BaseException:
        _release_all(taken)
        raise
    _release_all(taken)
    return [], core


def _release_all(locks: Sequence[Flock]) -> None:
    for lk in reversed(locks):
        lk.release()


def _scan(directory: str, blocks: Sequence[range]):
    """First block of ``blocks`` that could be locked whole: (block, locks) or None.

    Blocks are contiguous and start in ascending order (candidate_blocks), so a
    block that starts at or before the last busy core found contains it.
    """
    last_busy = -1
    for block in blocks:
        if block[0] <= last_busy:
            continue
        locks, failed = _try_block(directory, block)
        if failed is None:
            return block, locks
        last_busy = failed
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
    if blocks:
        _make_room_for(len(blocks[0]), _requested(request, blocks))
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


def _make_room_for(count: int, requested) -> None:
    """Raise the soft descriptor limit (toward the hard one) if ``count`` locks need it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    need = len(os.listdir("/proc/self/fd")) + count
    if soft >= need + _SPARE_FDS:
        return
    new = need + _SPARE_FDS if hard == resource.RLIM_INFINITY else min(hard, need + _SPARE_FDS)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < need:
        raise CoreUnavailableError(
            requested, 0, (), f"holding {count} cores keeps {count} files open, but this "
            f"process may open only {hard} (RLIMIT_NOFILE hard limit; see ulimit -Hn)")


@contextlib.contextmanager
def _allocation_mutex(base: Optional[str], requested):
    """Serialise scans (and the holder-record writes that end them) between processes.

    Without it, two processes scanning for blocks at once hold parts of blocks
    for a moment and push each other off the first free block, fragmenting the
    host (five NUM_CORES=3 racers on 16 cores could leave no room for the fifth).
    A short section held under ``with``: filelock's public API (a timeout, its
    logging) fits it, where the core locks need flock.py's descriptor semantics
    (docs/design.md, "Locks").  Being a flock, it dies with its holder; filelock
    retries by itself when tidy() unlinked the file it locked.
    """
    import filelock  # here, not at the top: 'import neuronmp' stays cheap

    while True:
        directory = cores_dir(base)
        mutex = _alloc_lock(directory)
        path = mutex.lock_file
        try:
            mutex.acquire(timeout=_MUTEX_TIMEOUT)
        except FileNotFoundError:
            continue  # the last process out removed the directory meanwhile (tidy)
        except filelock.Timeout as exc:
            raise CoreUnavailableError(
                requested, 0, (), f"another process kept {path} locked for "
                f"{_MUTEX_TIMEOUT:g} s while reserving (see neuronmp-ls)") from exc
        break
    try:
        yield directory
    finally:
        mutex.release()


def _alloc_lock(directory: str):
    """``<directory>/alloc.lock`` as a filelock (created 0600, never unlinked by it:
    tidy() does that, holding it through flock.py).

    One lock object per path in each process, made once and reused (a forked
    child makes its own: filelock refuses an inherited one): making one costs more than
    the flock itself (docs/design.md, "Locks").  Its state is per thread
    (``thread_local``), so threads of one process sharing it still exclude each
    other, each through a descriptor of its own, as separate objects did."""
    path = os.path.join(directory, ALLOC_LOCK)
    made = _alloc_locks.get(path)
    if made is None:
        import filelock

        made = filelock.UnixFileLock(path, mode=0o600,
                                     poll_interval=0.001, thread_local=True,
                                     fallback_to_soft=False, preserve_lock_file=True)
        with _alloc_locks_lock:
            if len(_alloc_locks) >= _ALLOC_LOCKS_KEPT:  # runtime directories come and go
                _alloc_locks.pop(next(iter(_alloc_locks)))
            made = _alloc_locks.setdefault(path, made)
    return made


_ALLOC_LOCKS_KEPT = 8
_alloc_locks: Dict[str, object] = {}   # path -> its filelock, oldest first
_alloc_locks_lock = threading.Lock()


def _forget_alloc_locks() -> None:
    """In a forked child: filelock refuses an instance made before the fork, so the
    child makes its own (and a fresh lock: a thread of the parent may have held it)."""
    global _alloc_locks_lock
    _alloc_locks.clear()
    _alloc_locks_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_alloc_locks)


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
    if directory is None:
        return False
    root = os.path.dirname(directory)
    try:
        mutex = Flock.try_acquire(os.path.join(directory, ALLOC_LOCK), create=False)
    except FileNotFoundError:
        return False  # gone already
    if mutex is None:
        return False  # someone is reserving
    try:
        if not mutex.linked() or not _remove_stale(directory) or _sweep_segments(root):
            return False
        _remove_all(directory)
    finally:
        mutex.release()
    dirs = [directory, os.path.join(root, paths.SHM), root]
    if paths.weights_setting() == paths.WEIGHTS_AUTO:  # a directory the user named stays
        dirs.append(paths.page_cache_dir(root, create=False))
    for path in filter(None, dirs):
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty (another user of the directory) or already gone
    return not os.path.exists(root)


def sweep_stale(base: Optional[str] = None) -> None:
    """Remove the holder records of free cores and the segments of dead owners.

    A process that died without releasing (SIGKILL, or a SIGTERM no handler
    caught) leaves its records; the kernel freed its locks, so a record whose
    core lock can be taken names nobody.  Runs at every runtime start-up, under
    ``alloc.lock`` like every reservation.
    """
    import filelock

    directory = cores_dir(base, create=False)
    if directory is None:
        return
    try:
        with _alloc_lock(directory).acquire(timeout=_MUTEX_TIMEOUT):
            _remove_stale(directory)
            _sweep_segments(os.path.dirname(directory))  # whether any remain: not asked
    except FileNotFoundError:
        return  # tidied away meanwhile: nothing stale
    except filelock.Timeout:
        return  # a stuck reserver: the next start-up sweeps


def _sweep_segments(root: str) -> bool:
    """Unlink the segments of owners proven dead (liveness), in ``shm/`` and the
    page-cache twin of shared weights; whether any remain."""
    remain = False
    for find in (paths.shm_dir, paths.page_cache_dir):
        try:
            directory = find(root, create=False)
        except (RuntimeDirError, ConfigError):
            return True  # not ours to judge, nor to remove
        if directory is not None:
            liveness.sweep(directory)
            remain = remain or bool(os.listdir(directory))
    return remain


def _remove_stale(directory: str) -> bool:
    """Unlink the holder record of every free core; True when every core is free.

    A core is free when its lock can be taken (held here, under alloc.lock, for
    the moment of the unlink, so nobody takes the core meanwhile).
    """
    all_free = True
    for name in os.listdir(directory):
        if not (name.startswith("nc") and name.endswith(".lock")):
            continue
        try:
            probe = Flock.try_acquire(os.path.join(directory, name), create=False)
        except FileNotFoundError:
            continue
        if probe is None:
            all_free = False
            continue
        try:
            _unlink(os.path.join(directory, name[:-len(".lock")] + ".holder"))
        finally:
            probe.release()
    return all_free


def _remove_all(directory: str) -> None:
    """Unlink every file of ``directory``, alloc.lock (held by the caller) last."""
    for name in os.listdir(directory):
        if name != ALLOC_LOCK:
            _unlink(os.path.join(directory, name))
    _unlink(os.path.join(directory, ALLOC_LOCK))


def _commit(directory: str, block: Sequence[int], locks: List[Flock]) -> Reservation:
    holder = _this_holder(block)
    record = _record(holder)
    try:
        for core in block:
            _write_holder(directory, core, record, holder.pid)
    except BaseException:
        for core in block:
            _remove_holder(directory, core, record)
        _release_all(locks)
        raise
    return Reservation(directory, tuple(block), locks, holder, record)


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
    return request.count if request.count is not None else tuple(blocks[0]) if blocks else ()


def reserve_timeout_from_env(environ: Optional[Mapping[str, str]] = None) -> float:
    """Seconds to wait for busy cores, from ``NEURONMP_RESERVE_TIMEOUT`` (default 0)."""
    if environ is None:
        return settings.get("reserve_timeout")
    return settings.parse_field("reserve_timeout", environ)
