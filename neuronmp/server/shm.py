"""The system shared-memory extension: regions clients register by /dev/shm key.

    client: shm_open("/in", ...) ─▶ POST /v2/systemsharedmemory/region/in/register
                                        {"key": "/in", "offset": 0, "byte_size": N}
    server: open /dev/shm/in (O_NOFOLLOW), check regular file, owner, mode, size
            mmap ─▶ Region ─▶ inputs read from / outputs written to [offset, offset+N)

A region is refused unless it is a regular file under /dev/shm owned by this
server's user and not writable by others (another user's region could change
under a request, or be a trap), and unless ``offset + byte_size`` fits the file.
Every read and write is checked against the registered bounds: a request can
never reach outside them.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from typing import Dict, List

from ..errors import SharedMemoryError

SHM_ROOT = "/dev/shm"
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,200}")


class Region:
    def __init__(self, name: str, key: str, offset: int, byte_size: int, mm: mmap.mmap):
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self._mm = mm

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the region, bounds checked."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.byte_size:
            raise SharedMemoryError(self.name, f"offset {offset} + {nbytes} bytes is outside "
                                    f"the region's {self.byte_size} bytes")
        start = self.offset + offset
        return memoryview(self._mm)[start:start + nbytes]

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with its last user
            pass


class Registry:
    """The regions registered with this server, by name (thread-safe)."""

    def __init__(self):
        self._regions: Dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        _check_args(name, key, offset, byte_size)
        with self._lock:
            if name in self._regions:
                raise SharedMemoryError(name, "a region of this name is already registered "
                                        "(unregister it first)")
            self._regions[name] = _open(name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        with self._lock:
            names = [name] if name else list(self._regions)
            for n in names:
                region = self._regions.pop(n, None)
                if region is not None:
                    region.close()

    def get(self, name: str) -> Region:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise SharedMemoryError(name, "no region of this name is registered")
        return region

    def status(self, name: str = "") -> List[dict]:
        with self._lock:
            if name and name not in self._regions:
                raise SharedMemoryError(name, "no region of this name is registered")
            return [r.status() for n, r in self._regions.items() if not name or n == name]


def _check_args(name: str, key: str, offset, byte_size) -> None:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise SharedMemoryError(name, f"key {key!r} is not a /dev/shm name such as '/input0' "
                                "(letters, digits, '_', '.', '-')")
    if key.strip("/") in (".", ".."):
        raise SharedMemoryError(name, f"key {key!r} is not a /dev/shm name")
    for what, v in (("offset", offset), ("byte_size", byte_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SharedMemoryError(name, f"{what} {v!r} is not a whole number >= 0")
    if byte_size == 0:
        raise SharedMemoryError(name, "byte_size 0: a region must hold at least one byte")


def _open(name: str, key: str, offset: int, byte_size: int) -> Region:
    path = os.path.join(SHM_ROOT, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SharedMemoryError(name, f"key {key!r}: no such region in {SHM_ROOT}") from None
    except OSError as exc:  # a symlink (ELOOP), no permission
        raise SharedMemoryError(name, f"key {key!r} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SharedMemoryError(name, f"key {key!r} is not a regular file")
        if st.st_uid != os.getuid():
            raise SharedMemoryError(name, f"key {key!r} belongs to uid {st.st_uid}, not to "
                                    f"this server's user ({os.getuid()})")
        if st.st_mode & 0o022:
            raise SharedMemoryError(name, f"key {key!r} has mode {stat.S_IMODE(st.st_mode):o}: "
                                    "other users may write it (0600 or 0644 are accepted)")
        if offset + byte_size > st.st_size:
            raise SharedMemoryError(name, f"offset {offset} + byte_size {byte_size} is past "
                                    f"the end of {key!r} ({st.st_size} bytes)")
        mm = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    return Region(name, key, offset, byte_size, mm)
