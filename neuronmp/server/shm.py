"""The system shared-memory extension: regions clients register by /dev/shm key.

    client: shm_open("/in", ...) ─▶ POST /v2/systemsharedmemory/region/in/register
                                        {"key": "/in", "offset": 0, "byte_size": N}
    server: peer on this host? ─▶ open /dev/shm/in (O_NOFOLLOW), check regular file,
            owner, mode, size, not one of neuronmp's own ─▶ Region (the fd, a
            read-only mapping; a writable one at the first write)
            request ─▶ fstat (still big enough?) ─▶ guarded copy [offset, offset+N)
                       (shm._guard)  False ─▶ fstat: shrank (400), else pread/pwrite

A region is refused unless it is a regular file under /dev/shm owned by this
server's user and not writable by others (another user's region could change
under a request, or be a trap), unless ``offset + byte_size`` fits the file, and
when it is one of neuronmp's own segments (rings, arenas, weights, stats: by their
name, or by what the file is, whatever name it is linked under).  Only peers on
this host may use the extension: loopback, or the Unix socket (``--unix-socket``)
from the regions' owner (peer credentials) or root.  At most
``NEURONMP_SHM_MAX_REGIONS`` regions are registered at once, each holding one
descriptor (and up to two mappings), so registrations cannot starve the listener
of them.

The client owns its file and may shrink it at any time; a mapping touched past
the file's new end raises SIGBUS, whose default kills the process.  So the server
touches a region's mapping only inside a guarded copy (``shm._guard``): a
process-wide SIGBUS handler jumps out of a copy that faults on its own operands
and the copy returns False; any other SIGBUS goes to the disposition that was
there before (faulthandler, the default), so real crashes still kill.  The size
is checked (fstat) at every use, so a request on a region that shrank is refused
(400); a shrink in the window between that check and the copy ends the copy with
False, and the request is refused the same way (or, when the file grew back
meanwhile, or the guard was displaced by another SIGBUS handler, served through
pread/pwrite on the descriptor, which no size change turns into a signal).
Inputs are copied out of the region (a view of it would be read later, unguarded);
outputs may be written straight into it where the core's answer is read
(``view``: the pool copies into it through the guard, see server/infer.py).
Every read and write is also checked against the registered bounds: a request
never reaches outside them.
"""
from __future__ import annotations

import ipaddress
import mmap
import os
import re
import socket
import stat
import struct
import threading
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from ..errors import NeuronmpError
from ..host import paths, settings
from ..shm import _guard
from .errors import SharedMemoryError

SHM_ROOT = "/dev/shm"
ENV_MAX_REGIONS = "NEURONMP_SHM_MAX_REGIONS"
#: Regions registered at once unless NEURONMP_SHM_MAX_REGIONS says otherwise.
DEFAULT_MAX_REGIONS = 256
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,200}")
# neuronmp's own files: segments and liveness locks (host/liveness.py's names), runtime
# and weights directories
_OWN_NAME = re.compile(r"nmp-\d+-\d+(?:-[0-9a-f]{16}|\.live)|neuronmp-.*")


def max_regions() -> int:
    """The region limit, from NEURONMP_SHM_MAX_REGIONS (ConfigError when malformed)."""
    return settings.get("shm_max_regions")


def check_peer(name: str, peer: Optional[str]) -> None:
    """Refuse a client that is not on this host: a region is a file of this host.

    ``peer`` is aiohttp's remote address (``'127.0.0.1'``, ``'::1'``), gRPC's peer
    (``'ipv4:127.0.0.1:5000'``, ``'ipv6:[::1]:5000'``), or ``'unix:uid=N'`` for a
    client on the Unix socket (``unix_peer``).  Only loopback counts as this host (an
    address of one of the host's interfaces could be a packet routed in from
    elsewhere); on the Unix socket, only the owner of the regions (this server's
    user) or root.
    """
    if peer and peer.startswith("unix:"):
        uid = peer[len("unix:uid="):] if peer.startswith("unix:uid=") else ""
        if uid.isdigit() and int(uid) in (os.getuid(), 0):
            return
        raise SharedMemoryError(name, f"the client {peer!r} on the Unix socket is not the "
                                f"owner of the regions (uid {os.getuid()}) or root")
    if not _on_this_host(peer):
        raise SharedMemoryError(name, f"the client {peer!r} is not on this host: shared "
                                "memory is served to loopback (127.0.0.1, ::1) and Unix "
                                "socket clients only")


def unix_peer(sock: socket.socket) -> str:
    """The peer of a connected Unix socket as ``check_peer`` takes it (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return f"unix:uid={uid}"


def _on_this_host(peer: Optional[str]) -> bool:
    if not peer:
        return False
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class Region:
    """One registered region: the file's descriptor, its mappings, and the bytes
    ``[offset, offset + byte_size)`` of it that requests may read and write."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int):
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self._fd = fd
        st = os.fstat(fd)
        self.file_id = (st.st_dev, st.st_ino)
        self._rmap: Optional[mmap.mmap] = self._map(mmap.PROT_READ)
        self._wmap: Optional[mmap.mmap] = None   # mapped at the first write
        self._waddr = 0
        self._lock = threading.Lock()   # a close never races a copy's mapping or descriptor

    def read(self, offset: int, nbytes: int) -> memoryview:
        """A copy of bytes ``[offset, offset + nbytes)`` of the region."""
        buf = np.empty(nbytes, np.uint8)
        with self._lock:
            start = self._at(offset, nbytes)
            if not _guard.read(self._rmap, start, _address(buf), nbytes):
                self._unguarded(memoryview(buf), start, write=False)
        return memoryview(buf)

    def write(self, offset: int, data) -> None:
        """Write ``data`` (a contiguous bytes-like object) at ``offset`` of the region."""
        src = np.frombuffer(data, np.uint8) if len(memoryview(data)) else np.empty(0, np.uint8)
        with self._lock:
            start = self._at(offset, src.nbytes)
            if not _guard.write(self._writable(), start, _address(src), src.nbytes):
                self._unguarded(memoryview(src), start, write=True)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Writable bytes ``[offset, offset + nbytes)`` of the region's mapping, for a
        copy through ``shm._guard`` only (any other touch of it may meet SIGBUS)."""
        with self._lock:
            start = self._at(offset, nbytes)
            return memoryview(self._writable())[start:start + nbytes]

    def address(self, offset: int) -> int:
        """Where byte ``offset`` of the region is in the writable mapping (0 if there
        is none yet): an output tensor there was written in place."""
        return self._waddr and self._waddr + self.offset + offset

    def _at(self, offset: int, nbytes: int) -> int:
        """The file position of ``offset``, checked against the registered bounds and
        against the file's size now."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.byte_size:
            raise SharedMemoryError(self.name, f"offset {offset} + {nbytes} bytes is outside "
                                    f"the region's {self.byte_size} bytes")
        if self._fd < 0:
            raise SharedMemoryError(self.name, "unregistered while the request used it")
        size = os.fstat(self._fd).st_size
        if size < self.offset + self.byte_size:
            raise self._shrank(size)
        return self.offset + offset

    def _map(self, prot: int) -> mmap.mmap:
        try:
            return mmap.mmap(self._fd, self.offset + self.byte_size, prot=prot)
        except (ValueError, OSError):   # shrunk since the size check
            raise self._shrank(os.fstat(self._fd).st_size) from None

    def _writable(self) -> mmap.mmap:
        if self._wmap is None:
            self._wmap = self._map(mmap.PROT_READ | mmap.PROT_WRITE)
            self._waddr = _address(np.frombuffer(self._wmap, np.uint8))
        return self._wmap

    def _unguarded(self, buf: memoryview, start: int, write: bool) -> None:
        """After a guarded copy came back False: the file shrank under it (400), or it
        grew back meanwhile, or the SIGBUS guard is not in place: then the descriptor
        (past the end a read comes back short and a write extends the file, no signal)."""
        size = os.fstat(self._fd).st_size
        if size < self.offset + self.byte_size:
            raise self._shrank(size)
        done = 0
        while done < len(buf):
            try:
                got = (os.pwrite(self._fd, buf[done:], start + done) if write else
                       os.preadv(self._fd, [buf[done:]], start + done))
            except OSError as exc:   # ENOSPC: a tmpfs full while a write refills a hole
                raise SharedMemoryError(self.name, f"key {self.key!r}: {exc.strerror}") from None
            if got == 0:
                raise self._shrank(os.fstat(self._fd).st_size)
            done += got

    def _shrank(self, size: int) -> SharedMemoryError:
        return SharedMemoryError(self.name, f"key {self.key!r} shrank to {size} bytes since it "
                                 f"was registered (offset {self.offset} + byte_size "
                                 f"{self.byte_size}): unregister it, then register it again")

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            maps, self._rmap, self._wmap = (self._rmap, self._wmap), None, None
            self._waddr = 0
        for m in maps:
            try:
                if m is not None:
                    m.close()
            except BufferError:   # a request's view still exported: unmapped with its last user
                pass
        if fd >= 0:
            os.close(fd)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Registry:
    """The regions registered with this server, by name (thread-safe)."""

    def __init__(self, limit: Optional[int] = None):
        self._regions: Dict[str, Region] = {}
        self._lock = threading.Lock()
        self.limit = max_regions() if limit is None else limit

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        _check_args(name, key, offset, byte_size)
        with self._lock:
            if name in self._regions:
                raise SharedMemoryError(name, "a region of this name is already registered "
                                        "(unregister it first)")
            if len(self._regions) >= self.limit:
                raise SharedMemoryError(name, f"at most {self.limit} regions may be registered "
                                        f"at once ({ENV_MAX_REGIONS}); unregister one first")
            # a file another region maps is not one of ours (/proc/self/maps lists it)
            registered = {r.file_id for r in self._regions.values()}
            self._regions[name] = _open(name, key, offset, byte_size, registered)

    def unregister(self, name: str = "") -> None:
        with self._lock:
            names = [name] if name else list(self._regions)
            for n in names:
                region = self._regions.pop(n, None)
                if region is not None:
                    region.close()

    def get(self, name: str) -> Region:
        if not isinstance(name, str):
            raise SharedMemoryError(str(name), "a region name is a string")
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


def _open(name: str, key: str, offset: int, byte_size: int,
          registered: Set[Tuple[int, int]]) -> Region:
    path = os.path.join(SHM_ROOT, key.lstrip("/"))
    if _OWN_NAME.fullmatch(key.lstrip("/")):
        raise SharedMemoryError(name, f"key {key!r} is named as neuronmp's own files are "
                                "(nmp-*, neuronmp-*): a client may not register them")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SharedMemoryError(name, f"key {key!r}: no such region in {SHM_ROOT}") from None
    except OSError as exc:  # a symlink (ELOOP), no permission
        raise SharedMemoryError(name, f"key {key!r} cannot be opened: {exc.strerror}") from None
    try:
        _check_file(name, key, os.fstat(fd), offset, byte_size, registered)
        return Region(name, key, offset, byte_size, fd)
    except BaseException:
        os.close(fd)
        raise


def _check_file(name: str, key: str, st: os.stat_result, offset: int, byte_size: int,
                registered: Set[Tuple[int, int]]) -> None:
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
    if (st.st_dev, st.st_ino) in _own_files() - registered:
        raise SharedMemoryError(name, f"key {key!r} is one of neuronmp's own segments "
                                "(a ring, an arena, weights or stats): a client may not "
                                "register it")


def _own_files() -> Set[Tuple[int, int]]:
    """(device, inode) of every file of this runtime's segment and weights folders,
    and of every file this process maps: a link to one is the same file."""
    own: Set[Tuple[int, int]] = set()
    folders = []
    for where in (paths.shm_dir, paths.page_cache_dir):
        try:
            folders.append(where(create=False))
        except NeuronmpError:   # not ours to read: nothing of ours is there either
            pass
    for folder in filter(None, folders):
        with os.scandir(folder) as entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:   # removed meanwhile
                    continue
                own.add((st.st_dev, st.st_ino))
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[4] != "0":
                    major, minor = fields[3].split(":")
                    own.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    except OSError:
        pass
    return own
