"""Shared weights: one read-only copy of a model's parameters and buffers for all its cores.

    coordinator: SharedWeights.publish(graph)          worker: MappedWeights(...)
      data.pkl read, no torch.jit.load                  torch.jit.load(skeleton): kilobytes
      each storage's zip entry ──▶ one segment          map the segment copy-on-write
      data.pkl rewritten, entries out ──▶ skeleton      each attribute = a view of the mapping
                   │ LOAD (skeleton, timing, wire())          │
                   └──────────────────────────────────────────┘

The coordinator owns the segment (its name carries the coordinator's pid, so a
dead coordinator's weights are swept like its rings) and drops its own mapping
once the weights are written: the pages live in the segment file, and every worker
of the model maps the same ones.  The file is on tmpfs (``<runtime dir>/shm``),
or for LARGE weights in the page cache of the temp filesystem when only there a
mapping takes one page-table entry per 2 MiB (``directory_for``): mapping is what
each core pays for its weights, once per 4 KiB page otherwise.  A
:class:`SharedWeights` counts the cores that load it and unlinks the segment when
the last one unloads (or the pool closes); a worker's mapping outlives the file
until the worker drops the model.

A worker maps the segment privately (MAP_PRIVATE, the file opened read-only):
reads share the pages, and a model that writes to a weight writes a private copy
of those pages, never the copy the other cores read.  All of a model's views come
from one base tensor, so they share one version counter, which every in-place
torch op bumps: one integer compared after each call tells whether the call wrote.
If it did, the call fails with :class:`~neuronmp.errors.WeightWriteError` naming
what was written (compared against the segment), and ``madvise(MADV_DONTNEED)``
drops the private pages, so the core's next call sees the shared weights again.
Writes that bypass torch's in-place ops (a C extension writing through
``data_ptr``) are not noticed, but still stay private to that core.

The coordinator reads the weights out of the archive (``archive.split``: the
storages are stored zip entries, data.pkl says which attribute views which), and
checks the skeleton it made loads with every shared attribute empty.  An archive
it does not follow (compressed entries, an opcode it does not model) is loaded
with torch.jit.load instead, the same result slower.  Tensors that are not plain
strided CPU tensors (quantized, sparse), and tensors held anywhere but an
attribute (a list), stay in the skeleton and load as copies, as before.
"""
from __future__ import annotations

import fcntl
import io
import mmap
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import ShmSpaceError, WeightWriteError
from ..host import _torchscript, liveness, paths
from ..shm.segment import MADV_POPULATE_READ, Segment, maps_large_pages, shm_dir
from . import archive
from .archive import ALIGN, owner_and_attr

#: weights this big or bigger go where they are mapped a huge page at a time (see
#: directory_for); below two huge pages there is nothing to save
LARGE = 4 << 20
_large_pages: Dict[str, bool] = {}  # directory -> maps_large_pages, measured once
_cleaner_locks: Dict[str, int] = {}  # directory -> descriptor holding LOCK_SH on it

# one manifest entry: (attribute paths, dtype name, shape, stride, offset in elements)
Entry = Tuple[Tuple[str, ...], str, Tuple[int, ...], Tuple[int, ...], int]


def _tensors(module: torch.jit.ScriptModule) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module``, under every path that reaches it."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, t in (*sub.named_parameters(recurse=False),
                        *sub.named_buffers(recurse=False)):
            if t is not None:
                yield (f"{prefix}.{name}" if prefix else name), t


def _shareable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
            and t.untyped_storage().nbytes() > 0)


def _set(module: torch.jit.ScriptModule, path: str, value: torch.Tensor) -> None:
    # the C++ module's setattr: nn.Module's would insist on a Parameter for a
    # parameter slot, and the slot's declared type (Tensor) is all TorchScript checks
    owner, attr = owner_and_attr(module, path)
    owner._c.setattr(attr, value)


class SharedWeights:
    """The coordinator's side: the segment it owns, the skeleton graph, the manifest.

    ``skeleton`` is the graph with every shared tensor emptied (what a core loads),
    ``manifest`` where each tensor lies in the segment; ``wire()`` is what a LOAD
    carries.  Counted: ``acquire`` per core that loads it, ``release`` per unload;
    the segment is unlinked at zero.
    """

    def __init__(self, segment: Segment, skeleton: bytes, manifest: Tuple[Entry, ...]):
        self.segment = segment
        self.skeleton = skeleton
        self.manifest = manifest
        self.nbytes = segment.size
        self._users = 1  # the publisher's own hold, dropped when its loads are sent
        self._lock = threading.Lock()

    @classmethod
    def publish(cls, graph: bytes) -> Optional[SharedWeights]:
        """Write the weights of ``graph`` (``torch.jit.save`` bytes) into a new segment.

        None when there is nothing to share, or when ``graph`` does not load here:
        the cores then get it whole and report its error as they always did.
        """
        try:
            found = archive.split(graph)
        except Exception:  # noqa: BLE001 - an archive this reader does not know: load it
            found = None
        if found is not None:
            return cls._from_split(graph, found)
        try:
            module = load_graph(graph)
        except Exception:  # noqa: BLE001 - the worker's load names the problem
            return None
        entries, storages, size = _plan(module)
        if not entries:
            return None
        segment = _write_segment(
            size, lambda: ((offset, raw.numpy()) for offset, raw in storages))
        try:
            for names, dtype, *_ in entries:
                for path in names:
                    _set(module, path, torch.empty(0, dtype=getattr(torch, dtype)))
            buf = io.BytesIO()
            with _torchscript.quiet():
                torch.jit.save(module, buf)
        except BaseException:
            segment.close()
            raise
        return cls(segment, buf.getvalue(), tuple(entries))

    @classmethod
    def _from_split(cls, graph, found: archive.Split) -> SharedWeights:
        """Copy each storage's zip entry from ``graph`` to its place in a new segment
        (in the plan's order, which is the segment's)."""
        mv = memoryview(graph).cast("B")
        plan = found.plan
        segment = _write_segment(
            found.size, lambda: ((offset, mv[start:start + n]) for offset, (start, n) in plan))
        return cls(segment, found.skeleton, found.entries)

    def wire(self) -> Tuple[str, str, Tuple[Entry, ...]]:
        """What a LOAD carries to a worker: the segment's directory and name, and the
        manifest."""
        return os.path.dirname(self.segment.path), self.segment.name, self.manifest

    def acquire(self) -> None:
        with self._lock:
            if self._users <= 0:
                raise RuntimeError(f"shared weights {self.segment.name} were released")
            self._users += 1

    def release(self) -> None:
        """One user fewer; the last one unlinks the segment."""
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.segment.close()

    def close(self) -> None:
        """Unlink the segment now, whoever still counts on it (the pool is closing)."""
        with self._lock:
            self._users = 0
        self.segment.close()

    @property
    def closed(self) -> bool:
        return self.segment.closed

    def __repr__(self) -> str:
        return (f"<SharedWeights {self.segment.name} {self.nbytes} bytes, "
                f"{len(self.manifest)} tensors, users={self._users}>")


def directory_for(nbytes: int) -> str:
    """Where a weight segment of ``nbytes`` goes (``NEURONMP_WEIGHTS_DIR``).

    ``auto``: the runtime directory's ``shm/``, unless the weights are LARGE, tmpfs
    maps them a 4 KiB page at a time and the runtime directory's page-cache twin
    (paths.page_cache_dir) maps them a huge page at a time.  Every core that loads a
    model maps all of its weights, one page-table entry per 4 KiB page on tmpfs
    without huge pages against one per huge folio in the page cache, and each entry
    costs every mapping core CPU (docs/performance.md, "Start-up, memory
    and shared weights").
    The page cache's pages are written back to the disk only
    if the weights outlive the kernel's dirty expiry (30 s by default), and are
    dropped unwritten when the segment is unlinked sooner.  ``shm``: always tmpfs;
    a path: always there."""
    setting = paths.weights_setting()
    shm = shm_dir()
    if setting == paths.WEIGHTS_SHM:
        return shm
    if setting != paths.WEIGHTS_AUTO:
        return _kept_from_cleaners(paths.page_cache_dir())
    if nbytes < LARGE or _maps_large(shm):
        return shm
    twin = paths.page_cache_dir()
    return _kept_from_cleaners(twin) if twin and _maps_large(twin) else shm


def _write_segment(size: int, pieces: Callable[[], Iterable[Tuple[int, Any]]]) -> Segment:
    """A new weight segment holding ``pieces()`` in ``directory_for(size)``; under
    ``auto``, on tmpfs after all when the page cache's filesystem has no room (tmpfs
    was the place before, and may have it)."""
    where = directory_for(size)
    try:
        return Segment.write_new(size, pieces(), where)
    except ShmSpaceError:
        shm = shm_dir()
        if where == shm or paths.weights_setting() != paths.WEIGHTS_AUTO:
            raise
        return Segment.write_new(size, pieces(), shm)


def _kept_from_cleaners(directory: str) -> str:
    """``directory``, with a shared BSD lock on it held for as long as this process
    lives: systemd-tmpfiles ages files out of /tmp (10 days by default) but skips a
    directory someone holds such a lock on, and a weight file it removed would be
    missing for a replacement worker.  Kept by inode: a directory tidied away and
    made again is locked again."""
    st = os.stat(directory)
    held = _cleaner_locks.get(directory)
    if held is not None:
        held_st = os.fstat(held)
        if (held_st.st_dev, held_st.st_ino) == (st.st_dev, st.st_ino):
            return directory
        os.close(held)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _cleaner_locks[directory] = fd
    return directory


def _maps_large(directory: str) -> bool:
    if directory not in _large_pages:
        _large_pages[directory] = maps_large_pages(directory)
    return _large_pages[directory]


def sweep(base: Optional[str] = None) -> List[str]:
    """Unlink what dead owners left in runtime directory ``base``'s page-cache twin
    (``shm/`` is shm.segment.sweep's); the names unlinked."""
    twin = paths.page_cache_dir(base, create=False)  # a bad named one fails here, at start
    return [] if twin is None else liveness.sweep(twin)


def load_graph(graph) -> torch.jit.ScriptModule:
    """``torch.jit.load`` of ``graph`` (bytes, or any contiguous buffer), read from a
    file: from a buffer, torch copies it into bytes of its own first and loads a
    large model several times slower (docs/performance.md, "Figures behind the
    code's choices").  The file is a segment (tmpfs, named for this process, so a
    crash leaves nothing a sweep keeps); with no room for it, the buffer it is."""
    try:
        scratch = Segment.create(len(graph), populate=False)
    except ShmSpaceError:
        with _torchscript.quiet():
            return torch.jit.load(io.BytesIO(bytes(graph)), map_location="cpu")
    try:
        with open(scratch.path, "r+b") as f:
            f.write(graph)
            f.truncate(len(graph))  # the segment is page-rounded: the zip ends here
        scratch.unmap()
        with _torchscript.quiet():
            return torch.jit.load(scratch.path, map_location="cpu")
    finally:
        scratch.close()


def _plan(module: torch.jit.ScriptModule):
    """The manifest, the storages to write (offset, bytes as a uint8 tensor) and the
    segment size.  Each storage is written once, at its own offset, and every tensor
    is a view of it with its own shape, stride and offset: tied weights stay tied,
    and a parameter that is a view of a bigger storage keeps its layout."""
    storages: Dict[int, Tuple[int, torch.Tensor]] = {}
    views: Dict[tuple, List[str]] = {}
    size = 0
    for path, t in _tensors(module):
        if not _shareable(t):
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in storages:
            raw = torch.empty(0, dtype=torch.uint8).set_(st)
            storages[st.data_ptr()] = (size, raw)
            size += -(-st.nbytes() // ALIGN) * ALIGN
        offset = storages[st.data_ptr()][0] // t.element_size() + t.storage_offset()
        key = (str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()), offset)
        views.setdefault(key, []).append(path)
    entries = [(tuple(paths), *key) for key, paths in views.items()]
    return entries, list(storages.values()), size


class MappedWeights:
    """A worker's side: its copy-on-write mapping of one model's shared weights.

    Points every shared attribute of ``module`` at a view of the mapping.
    ``check()`` after each call of the model raises WeightWriteError if the call
    wrote to any of them (and restores them first).
    """

    def __init__(self, module: torch.jit.ScriptModule, directory: str, name: str,
                 manifest: Sequence[Entry], core: int, model: int):
        self.directory = directory
        self.name = name
        self.core = core
        self.model = model
        self.module_name = _module_name(module)
        self.manifest = tuple(tuple(e) for e in manifest)
        self.mm = Segment.map_copy(name, directory)
        _populate(self.mm)
        # normal tensors, not inference tensors: only those keep a version counter
        with torch.inference_mode(False):
            self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
            for names, dtype, shape, stride, offset in self.manifest:
                view = self.base.view(getattr(torch, dtype)).as_strided(shape, stride, offset)
                for path in names:
                    _set(module, path, view)
        self.version = self.base._version

    def check(self) -> None:
        """Raise WeightWriteError if the last call wrote to the shared weights."""
        if self.base._version != self.version:
            self._refuse()

    def _refuse(self) -> None:
        written = self.written()
        self.restore()
        raise WeightWriteError(self.core, self.model, self.module_name,
                               [_short(p) for p in written])

    def written(self) -> List[str]:
        """The attribute paths whose bytes differ from the segment's."""
        seg = Segment.attach(self.name, self.directory)
        try:
            mine = memoryview(self.mm)
            out = []
            for names, dtype, shape, stride, offset in self.manifest:
                lo, hi = _span(dtype, shape, stride, offset)
                if mine[lo:hi] != seg.buf[lo:hi]:
                    out.append(names[0])
            mine.release()
            return out
        finally:
            seg.close()

    def restore(self) -> None:
        """Drop the pages this worker wrote: the mapping reads the segment again."""
        self.mm.madvise(mmap.MADV_DONTNEED)
        _populate(self.mm)
        self.version = self.base._version

    def close(self) -> None:
        """Forget the views (the module that used them is gone); the mapping goes
        with the last tensor that views it."""
        self.base = None
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced somewhere: GC unmaps it later
            pass


def _populate(mm: mmap.mmap) -> None:
    """Map the shared pages now (no page faults on the first call), without copying."""
    try:
        mm.madvise(MADV_POPULATE_READ)
    except OSError:  # an older kernel: the first call faults them in
        pass


def _span(dtype: str, shape, stride, offset: int) -> Tuple[int, int]:
    """The byte range of the mapping a strided view covers."""
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    if any(n == 0 for n in shape):
        return offset * size, offset * size
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    return offset * size, (last + 1) * size


def _module_name(module: torch.jit.ScriptModule) -> str:
    """The user's module class, as a traced graph keeps it (runner.inner.func)."""
    try:
        return module.inner.func.original_name
    except AttributeError:
        return getattr(module, "original_name", type(module).__name__)


def _short(path: str) -> str:
    """A path as the user's module names it (without the runner's wrapping)."""
    for prefix in ("inner.func.", "inner."):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path
