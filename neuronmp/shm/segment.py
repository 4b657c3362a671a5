"""Shared-memory segments: files in <runtime dir>/shm/, reserved and mapped.

    Segment.create(size)            Segment.attach(name)
        |  open O_EXCL, mode 0600        |  open O_RDWR (same user only: the
        |  posix_fallocate(size)         |  directory is 0700)
        |  mmap MAP_SHARED|POPULATE      |  mmap MAP_SHARED|POPULATE
        v                                v
      .buf  <------ same pages ------>  .buf
        |
      close(): the owner unlinks; sweep() unlinks what dead owners left

    Segment.write_new(size, pieces): a segment written once through its file and
    not mapped by its owner (shared weights); no reservation pass, no holes

    Segment.map_copy(name) -> mmap: a copy-on-write mapping of a segment
    (MAP_PRIVATE): reads share the segment's pages with every other mapper,
    writes land on private copies, and the file itself is opened read-only.

    maps_large_pages(dir): whether such a mapping of a file in ``dir`` takes one
    page-table entry per 2 MiB (a huge page) rather than per 4 KiB page

A segment is owned by the process that created it; its name carries the
owner's pid and start time (``nmp-<pid>-<start>-<random>``), and before its
first segment the owner locks ``nmp-<pid>-<start>.live`` beside it (host/liveness.py),
so ``sweep()`` can tell, after a SIGKILL, which files nobody will ever unlink
-- and never takes a live owner's files for dead ones, even one in another PID
namespace.  The space is
reserved up front with ``posix_fallocate`` and the pages faulted in at map
time: a full /dev/shm is a ``ShmSpaceError`` at creation, never a SIGBUS on
some later write.  This module does not import torch.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from typing import Any, Iterable, List, Optional, Tuple

from ..errors import ShmSpaceError
from ..host import liveness, paths, procid

_NAME = re.compile(r"^nmp-(\d+)-(\d+)-[0-9a-f]{16}$")
_PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14+: fault the pages in without writing them


def shm_dir() -> str:
    """The directory holding this user's segments (``<runtime dir>/shm``)."""
    return paths.subdir("shm")


def _new_name() -> str:
    me = procid.current()
    return f"nmp-{me.pid}-{me.start}-{secrets.token_hex(8)}"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"Invalid segment name {name!r}: expected a name made by Segment.create, "
            "such as 'nmp-<pid>-<start>-<16 hex digits>'"
        )


class Segment:
    """One mapped shared-memory file.

    ``buf`` is a writable memoryview of the whole mapping (None after ``unmap``),
    ``mm`` the mmap object itself (for the C helper), ``name`` what a peer passes
    to ``attach``, ``owner`` whether this side unlinks it on ``close``.
    """

    __slots__ = ("name", "path", "size", "owner", "mm", "buf", "_closed")

    def __init__(self, name: str, path: str, size: int, mm: Optional[mmap.mmap],
                 owner: bool):
        self.name = name
        self.path = path
        self.size = size
        self.owner = owner
        self.mm = mm
        self.buf = memoryview(mm) if mm is not None else None
        self._closed = False

    @classmethod
    def create(cls, size: int, directory: Optional[str] = None, *,
               populate: bool = True) -> Segment:
        """A new zero-filled segment of ``size`` bytes (rounded up to a page), owned here.

        Raises ShmSpaceError when the filesystem cannot hold ``size`` bytes.
        ``populate=False`` maps the (reserved) pages only when first touched.
        """
        name, path, size, fd = _new_file(size, directory, os.O_RDWR)
        try:
            _reserve(fd, path, size)
            mm = _map(fd, size, populate)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return cls(name, path, size, mm, owner=True)

    @classmethod
    def write_new(cls, size: int, pieces: Iterable[Tuple[int, object]],
                  directory: Optional[str] = None) -> Segment:
        """A new segment of ``size`` bytes (rounded up to a page) holding ``pieces``,
        ``(offset, bytes-like)`` in increasing, non-overlapping order, zeros elsewhere;
        written through the file and not mapped here (``buf`` is None).

        No ``posix_fallocate`` first: tmpfs allocates each page as the write reaches
        it, where reserving took a pass of its own (docs/performance.md, "Start-up,
        memory and shared weights").  Every byte up to ``size`` is written, so no
        page is a hole that a reader's fault would have to allocate (a SIGBUS in a
        full filesystem); a full filesystem is a ShmSpaceError here, as in ``create``.
        """
        name, path, size, fd = _new_file(size, directory, os.O_WRONLY)
        try:
            _check_free(fd, path, size)
            _write_all(fd, path, size, pieces)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return cls(name, path, size, None, owner=True)

    @classmethod
    def attach(cls, name: str, directory: Optional[str] = None, *,
               populate: bool = True) -> Segment:
        """Map an existing segment made by ``create`` (possibly in another process)."""
        path, fd = _open_existing(name, directory, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = _map(fd, size, populate)
        finally:
            os.close(fd)
        return cls(name, path, size, mm, owner=False)

    def unmap(self) -> None:
        """Drop this process's mapping but keep the file (the owner still unlinks it
        on ``close``): a segment written once and read only by others (shared
        weights) then costs this process no memory."""
        if self.buf is None:
            return
        self.buf.release()
        self.mm.close()
        self.buf = None

    @staticmethod
    def map_copy(name: str, directory: Optional[str] = None) -> mmap.mmap:
        """A copy-on-write mapping of segment ``name`` (see the module docstring).

        Nothing is faulted in here: MAP_POPULATE on a writable private mapping would
        copy every page.  Reads fault the shared pages in, a few at a time.
        """
        _, fd = _open_existing(name, directory, os.O_RDONLY)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the file now (mappings stay valid until closed)."""
        _unlink(self.path)

    def close(self) -> None:
        """Unmap (as soon as no view is exported) and, for the owner, unlink."""
        if self._closed:
            return
        self._closed = True
        if self.owner:
            _unlink(self.path)
        if self.buf is None:  # unmapped already
            return
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            # Views handed out (zero-copy tensors, a waiter inside the C helper)
            # still use the pages: the mapping goes when the last of them does.
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, size={self.size}, owner={self.owner})"


def _new_file(size: Any, directory: Optional[str], mode: int) -> Tuple[str, str, int, int]:
    """A new segment file of ours: (name, path, size rounded up to a page, fd)."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"Invalid segment size {size!r}: expected a positive int of bytes")
    size = -(-size // _PAGE) * _PAGE
    directory = directory or shm_dir()
    liveness.hold(directory)  # before the file: a sweeper must never see it ownerless
    name = _new_name()
    path = os.path.join(directory, name)
    fd = os.open(path, mode | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    return name, path, size, fd


def _reserve(fd: int, path: str, size: int) -> None:
    """Back every byte with memory now, so a later write cannot SIGBUS."""
    _check_free(fd, path, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        _raise_if_full(exc, fd, path, size)
        raise


def _check_free(fd: int, path: str, size: int) -> None:
    # tmpfs fallocate (or a write) would first allocate all it can before giving
    # up; refusing an impossible size up front keeps that from eating the RAM.
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ShmSpaceError(os.path.dirname(path), size, free)


def _raise_if_full(exc: OSError, fd: int, path: str, size: int) -> None:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
        st = os.fstatvfs(fd)
        raise ShmSpaceError(os.path.dirname(path), size, st.f_bavail * st.f_frsize) from None


_ZEROS = bytes(1 << 16)


def _write_all(fd: int, path: str, size: int, pieces: Iterable[Tuple[int, object]]) -> None:
    """Write ``pieces`` at their offsets and zeros between them, up to ``size``."""
    at = 0
    try:
        for offset, data in pieces:
            if offset < at:
                raise ValueError(f"segment pieces overlap or are out of order at {offset}")
            at = _write_zeros(fd, at, offset)
            at += _write_fully(fd, memoryview(data).cast("B"))
        if at > size:
            raise ValueError(f"segment pieces end at {at}, past its size {size}")
        _write_zeros(fd, at, size)
    except OSError as exc:
        _raise_if_full(exc, fd, path, size)
        raise


def _write_zeros(fd: int, at: int, end: int) -> int:
    while at < end:
        at += _write_fully(fd, memoryview(_ZEROS)[:end - at])
    return at


def _write_fully(fd: int, mv: memoryview) -> int:
    done = 0
    while done < len(mv):
        done += os.write(fd, mv[done:])
    return done


def _open_existing(name: str, directory: Optional[str], mode: int) -> Tuple[str, int]:
    """Path and descriptor of segment ``name``, never through a symlink."""
    _check_name(name)
    path = os.path.join(directory or shm_dir(), name)
    try:
        return path, os.open(path, mode | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"No shared-memory segment {name!r} (its owner closed it or died)",
            path) from None


def _map(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_PMD = 2 << 20
_PMD_FIELDS = (b"FilePmdMapped:", b"ShmemPmdMapped:")


def maps_large_pages(directory: str) -> bool:
    """Whether a segment written in ``directory`` and mapped with ``map_copy`` is
    mapped a huge page at a time: tmpfs with ``huge=`` on, or a filesystem whose page
    cache holds large folios (ext4 from Linux 6.16, XFS).  Mapping a model's weights
    a 4 KiB page at a time costs each mapping process far more CPU (see
    docs/performance.md, "Start-up, memory and shared weights").

    Measured, not guessed from kernel versions and mount options: a 4 MiB segment is
    written, mapped and faulted in, and this process's PMD-mapped file memory
    (``/proc/self/smaps_rollup``) compared before and after.  False when anything in
    that fails; a few milliseconds, so callers keep the answer."""
    seg = None
    try:
        seg = Segment.write_new(2 * _PMD, ((0, bytes(2 * _PMD)),), directory)
        before = _pmd_mapped_kib()
        mm = Segment.map_copy(seg.name, directory)
        try:
            mm.madvise(MADV_POPULATE_READ)
            after = _pmd_mapped_kib()
        finally:
            mm.close()
        return after - before >= _PMD >> 10
    except (OSError, ValueError):
        return False
    finally:
        if seg is not None:
            seg.close()


def _pmd_mapped_kib() -> int:
    with open("/proc/self/smaps_rollup", "rb") as f:
        lines = f.read().splitlines()
    return sum(int(line.split()[1]) for line in lines if line.startswith(_PMD_FIELDS))


def owner_of(name: str) -> Optional[procid.ProcId]:
    """The (pid, start) recorded in a segment name, or None for a foreign file."""
    m = _NAME.match(name)
    return procid.ProcId(int(m.group(1)), int(m.group(2))) if m else None


def sweep(directory: Optional[str] = None) -> List[str]:
    """Unlink the segments (and .live files) of owners proven dead; the segments' names.

    Run at start-up (the runtime and the pool do): segments of a SIGKILLed process
    are otherwise never removed, and a few of them fill a small /dev/shm.  An
    owner that may be alive (its .live file is locked, or missing and /proc
    cannot tell) keeps its segments (liveness.state).
    """
    return [n for n in liveness.sweep(directory or shm_dir()) if _NAME.match(n)]
