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
of the model maps the same ones.  A :class:`SharedWeights` counts the cores that
load it and unlinks the segment when the last one unloads (or the pool closes);
a worker's mapping outlives the file until the worker drops the model.

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

The coordinator reads the weights out of the archive (``_from_archive``: the
storages are stored zip entries, data.pkl says which attribute views which), and
checks the skeleton it made loads with every shared attribute empty.  An archive
it does not follow (compressed entries, an opcode it does not model) is loaded
with torch.jit.load instead, the same result slower.  Tensors that are not plain
strided CPU tensors (quantized, sparse), and tensors held anywhere but an
attribute (a list), stay in the skeleton and load as copies, as before.
"""
from __future__ import annotations

import io
import mmap
import pickletools
import struct
import threading
import zipfile
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import _torchscript
from ..errors import WeightWriteError
from ..ipc.segment import Segment

_ALIGN = 64  # every storage starts on a cache line (and so at any dtype's alignment)
_MADV_POPULATE_READ = 22  # Linux 5.14+: fault the pages in without writing them

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


def _owner_and_attr(module: torch.jit.ScriptModule, path: str):
    *parts, attr = path.split(".")
    for p in parts:
        module = getattr(module, p)
    return module, attr


def _set(module: torch.jit.ScriptModule, path: str, value: torch.Tensor) -> None:
    # the C++ module's setattr: nn.Module's would insist on a Parameter for a
    # parameter slot, and the slot's declared type (Tensor) is all TorchScript checks
    owner, attr = _owner_and_attr(module, path)
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
            found = _from_archive(graph)
        except Exception:  # noqa: BLE001 - an archive this reader does not know: load it
            found = None
        if found is not None:
            return found
        try:
            module = _load(graph)
        except Exception:  # noqa: BLE001 - the worker's load names the problem
            return None
        entries, storages, size = _plan(module)
        if not entries:
            return None
        segment = Segment.create(size, populate=False)
        try:
            segment.unmap()  # written through the file: no page of it mapped here
            _write(segment, storages)
            for paths, dtype, *_ in entries:
                for path in paths:
                    _set(module, path, torch.empty(0, dtype=getattr(torch, dtype)))
            buf = io.BytesIO()
            with _torchscript.quiet():
                torch.jit.save(module, buf)
        except BaseException:
            segment.close()
            raise
        return cls(segment, buf.getvalue(), tuple(entries))

    def wire(self) -> Tuple[str, Tuple[Entry, ...]]:
        """What a LOAD carries to a worker: the segment's name and the manifest."""
        return self.segment.name, self.manifest

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


# -- the weights straight from the archive ------------------------------------------
#
# torch.jit.save stores every storage as an uncompressed zip entry
# <archive>/data/<key>, and data.pkl says which attribute is a view of which key.
# Reading those two takes no torch.jit.load: the coordinator's load of the whole
# graph (a 200 MB copy into fresh pages, after another into a scratch file) was
# most of a model's load on 32 cores.  The entries' bytes go straight into the
# segment, and the skeleton is the archive without them, data.pkl rewritten so
# that each shared attribute is an empty tensor (what the loading path makes).
# Anything this reader does not know sends the graph down the loading path.

_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
_REBUILD = "torch._utils _rebuild_tensor_v2"
_INTS = {"BININT1", "BININT2", "BININT", "LONG1", "INT", "LONG"}
_PUTS = {"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"}
_GETS = {"BINGET", "LONG_BINGET", "GET"}


class _Unknown(Exception):
    """data.pkl holds something this reader does not follow."""


class _Bytes(io.RawIOBase):
    """A read-only file over the graph's bytes, for zipfile: nothing copied but
    what is read (headers)."""

    def __init__(self, data):
        self._mv = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = (0, self._pos, len(self._mv))[whence] + pos
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(self._pos + n, len(self._mv))
        out = bytes(self._mv[self._pos:end])
        self._pos = max(end, self._pos)
        return out


class _Item:
    """One value on the simulated pickle stack: its kind, value, and the bytes of
    data.pkl that made it."""

    __slots__ = ("kind", "val", "start", "end", "kids")

    def __init__(self, kind, val, start, end, kids=()):
        self.kind, self.val, self.start, self.end, self.kids = kind, val, start, end, kids


class _Storage:
    __slots__ = ("key", "dtype", "numel", "numel_span", "tensors")

    def __init__(self, key, dtype, numel, numel_span):
        self.key, self.dtype, self.numel, self.numel_span = key, dtype, numel, numel_span
        self.tensors = []


class _Tensor:
    __slots__ = ("storage", "offset", "size", "stride", "spans", "refs", "paths")

    def __init__(self, storage, offset, size, stride, spans):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.spans = spans  # (start, end) of offset, size, stride in data.pkl
        self.refs = 1       # times the pickle pushes it (made, then each memo get)
        self.paths = []     # the attribute paths that reach it


class _Obj:
    __slots__ = ("cls", "state")

    def __init__(self, cls):
        self.cls, self.state = cls, None


def _scan(data: bytes):
    """Simulate data.pkl's opcodes: the root object, every tensor made, the memo ops'
    positions.  Raises _Unknown on an opcode it does not model."""
    ops = list(pickletools.genops(data))
    stack: List[_Item] = []
    memo: Dict[int, _Item] = {}
    tensors: List[_Tensor] = []
    storages: Dict[str, _Storage] = {}
    puts: List[int] = []
    root = None

    def to_mark():
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].kind == "mark":
                kids, mark = stack[i + 1:], stack[i]
                del stack[i:]
                return mark, kids
        raise _Unknown("no MARK")

    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "MARK":
            stack.append(_Item("mark", None, pos, end))
        elif name in _INTS:
            stack.append(_Item("int", arg, pos, end))
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"):
            stack.append(_Item("str", arg, pos, end))
        elif name in ("NEWTRUE", "NEWFALSE", "NONE", "BINFLOAT", "FLOAT", "SHORT_BINBYTES",
                      "BINBYTES", "BINBYTES8"):
            stack.append(_Item("other", arg, pos, end))
        elif name == "GLOBAL":
            stack.append(_Item("global", arg, pos, end))
        elif name == "EMPTY_TUPLE":
            stack.append(_Item("tuple", (), pos, end, ()))
        elif name == "EMPTY_DICT":
            stack.append(_Item("dict", {}, pos, end))
        elif name == "EMPTY_LIST":
            stack.append(_Item("list", [], pos, end))
        elif name in _PUTS:
            puts.append(pos)
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in _GETS:
            got = memo[arg]
            if got.kind == "tensor":
                got.val.refs += 1
            stack.append(_Item(got.kind, got.val, pos, end, got.kids))
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            if name == "TUPLE":
                mark, kids = to_mark()
                start = mark.start
            else:
                n = int(name[-1])
                kids = stack[-n:]
                del stack[-n:]
                start = kids[0].start
            stack.append(_Item("tuple", tuple(k.val for k in kids), start, end, tuple(kids)))
        elif name == "BINPERSID":
            pid = stack.pop()
            stack.append(_Item("storage", _storage(pid, storages), pid.start, end))
        elif name == "REDUCE":
            args, fn = stack.pop(), stack.pop()
            val, kind = None, "other"
            if fn.kind == "global" and fn.val == _REBUILD:
                val = _tensor(args)
                if val is not None:
                    kind = "tensor"
                    tensors.append(val)
            stack.append(_Item(kind, val, fn.start, end))
        elif name == "NEWOBJ":
            stack.pop()
            cls = stack.pop()
            stack.append(_Item("obj", _Obj(cls.val), cls.start, end))
        elif name == "SETITEMS":
            _mark, kids = to_mark()
            _set_items(stack[-1], kids)
        elif name == "SETITEM":
            kids = stack[-2:]
            del stack[-2:]
            _set_items(stack[-1], kids)
        elif name == "BUILD":
            state = stack.pop()
            if stack[-1].kind == "obj" and state.kind == "dict":
                stack[-1].val.state = state.val
        elif name == "APPENDS":
            to_mark()
        elif name == "APPEND":
            stack.pop()
        elif name == "STOP":
            root = stack.pop()
        else:
            raise _Unknown(name)
    if root is None or root.kind != "obj":
        raise _Unknown("the root is not an object")
    return root.val, tensors, storages, puts


def _storage(pid: _Item, storages: Dict[str, _Storage]) -> Optional[_Storage]:
    kids = pid.kids
    if (pid.kind != "tuple" or len(kids) != 5 or kids[0].val != "storage"
            or kids[1].kind != "global" or kids[4].kind != "int"):
        return None
    module, _, cls = str(kids[1].val).partition(" ")
    dtype = _STORAGE_DTYPES.get(cls) if module == "torch" else None
    if dtype is None or kids[3].val != "cpu" or kids[2].kind != "str":
        return None
    key = kids[2].val
    if key in storages:  # the same key twice: not what torch.jit.save writes
        raise _Unknown(f"storage {key} made twice")
    storages[key] = _Storage(key, dtype, kids[4].val, (kids[4].start, kids[4].end))
    return storages[key]


def _tensor(args: _Item) -> Optional[_Tensor]:
    kids = args.kids
    if args.kind != "tuple" or len(kids) < 4:
        return None
    storage, offset, size, stride = kids[:4]
    if (storage.kind != "storage" or storage.val is None or offset.kind != "int"
            or size.kind != "tuple" or stride.kind != "tuple"
            or not all(isinstance(v, int) for v in (*size.val, *stride.val))):
        return None
    t = _Tensor(storage.val, offset.val, size.val, stride.val,
                ((offset.start, offset.end), (size.start, size.end), (stride.start, stride.end)))
    storage.val.tensors.append(t)
    return t


def _set_items(target: _Item, kids: List[_Item]) -> None:
    if target.kind != "dict" or len(kids) % 2:
        return
    for k, v in zip(kids[::2], kids[1::2]):
        if k.kind == "str":
            target.val[k.val] = v


def _walk(obj: _Obj, prefix: str, seen: set) -> None:
    """Give every tensor an object attribute holds the paths that reach it."""
    first = id(obj) not in seen
    seen.add(id(obj))
    for name, item in (obj.state or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        if item.kind == "tensor" and item.val is not None:
            item.val.paths.append((path, first))
        elif item.kind == "obj":
            _walk(item.val, path, seen)


def _entries(data, names: Dict[str, zipfile.ZipInfo]) -> Dict[str, Tuple[int, int]]:
    """Each stored entry's (start, size) in the archive's bytes."""
    mv = memoryview(data).cast("B")
    out = {}
    for name, info in names.items():
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            continue
        h = info.header_offset
        sig, n, extra = struct.unpack("<4s22xHH", mv[h:h + 30])
        if sig != b"PK\x03\x04":
            raise _Unknown(f"no local header at {h}")
        out[name] = (h + 30 + n + extra, info.file_size)
    return out


def _from_archive(graph) -> Optional[SharedWeights]:
    """SharedWeights.publish without loading the graph; None when the archive is not
    one this reader follows (the caller loads it instead) or has nothing to share."""
    with zipfile.ZipFile(_Bytes(graph)) as z:
        infos = {i.filename: i for i in z.infolist()}
        pkl = [n for n in infos if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pkl) != 1:
            return None
        prefix = pkl[0][:-len("data.pkl")]
        data = z.read(pkl[0])
    if any(not n.startswith(prefix) for n in infos):
        return None
    where = _entries(graph, infos)
    root, tensors, storages, puts = _scan(data)
    _walk(root, "", set())
    shared: List[_Storage] = []
    for st in storages.values():
        loc = where.get(f"{prefix}data/{st.key}")
        nbytes = st.numel * torch.empty(0, dtype=getattr(torch, st.dtype)).element_size()
        # every push of each of its tensors is an attribute of an object: no list,
        # dict or other value of the graph keeps a tensor the skeleton empties
        if (loc is None or loc[1] != nbytes or nbytes == 0 or not st.tensors or any(
                t.refs != sum(first for _p, first in t.paths) for t in st.tensors)):
            continue
        shared.append(st)
    if not shared:
        return None
    patches = []
    views: Dict[tuple, List[str]] = {}
    plan, size = [], 0
    for st in shared:
        patches.append((*st.numel_span, b"K\x00"))  # BININT1 0: an empty storage
        itemsize = torch.empty(0, dtype=getattr(torch, st.dtype)).element_size()
        plan.append((size, where[f"{prefix}data/{st.key}"]))
        for t in st.tensors:
            (o0, o1), (s0, s1), (r0, r1) = t.spans
            # offset 0, size (0,), stride (1,): torch.empty(0) of the storage's dtype
            patches += [(o0, o1, b"K\x00"), (s0, s1, b"(K\x00t"), (r0, r1, b"(K\x01t")]
            key = (st.dtype, tuple(t.size), tuple(t.stride), size // itemsize + t.offset)
            views.setdefault(key, []).extend(p for p, _first in t.paths)
        size += -(-st.numel * itemsize // _ALIGN) * _ALIGN
    patches.sort()
    for (_a0, a1, _x), (b0, _b1, _y) in zip(patches, patches[1:]):
        if b0 < a1:
            raise _Unknown("overlapping rewrites of data.pkl")
    # a memo store inside or right after a rewritten value would hand the rewrite
    # to a later get (torch.jit.save memoizes neither ints nor these tuples)
    if any(a0 < p <= a1 for a0, a1, _x in patches for p in puts):
        raise _Unknown("a memo store of a rewritten value")
    pieces, at = [], 0
    for a0, a1, new in patches:
        pieces += [data[at:a0], new]
        at = a1
    pieces.append(data[at:])
    entries = [(tuple(paths), *key) for key, paths in views.items()]
    skeleton = _skeleton(graph, prefix, infos, where, b"".join(pieces),
                         {f"{prefix}data/{st.key}" for st in shared})
    if not _is_skeleton_of(skeleton, entries):
        return None
    segment = Segment.create(size, populate=False)
    try:
        segment.unmap()  # written through the file: no page of it mapped here
        mv = memoryview(graph).cast("B")
        with open(segment.path, "r+b") as f:
            for offset, (start, n) in plan:
                f.seek(offset)
                f.write(mv[start:start + n])
    except BaseException:
        segment.close()
        raise
    return SharedWeights(segment, skeleton, tuple(entries))


def _skeleton(graph, prefix: str, infos, where, data_pkl: bytes, emptied: set) -> bytes:
    """The archive again, with data.pkl rewritten and the shared entries empty."""
    mv = memoryview(graph).cast("B")
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    with zipfile.ZipFile(_Bytes(graph)) as z:
        for name in infos:
            record = name[len(prefix):]
            if name in emptied:
                body = b""
            elif name == f"{prefix}data.pkl":
                body = data_pkl
            elif name in where:
                start, n = where[name]
                body = bytes(mv[start:start + n])
            else:
                body = z.read(name)
            writer.write_record(record, body, len(body))
    writer.write_end_of_file()
    return buf.getvalue()


def _is_skeleton_of(skeleton: bytes, entries) -> bool:
    """The skeleton loads, and every shared path in it is an empty tensor of its dtype."""
    try:
        with _torchscript.quiet():
            module = torch.jit.load(io.BytesIO(skeleton), map_location="cpu")
        for paths, dtype, *_ in entries:
            for path in paths:
                owner, attr = _owner_and_attr(module, path)
                t = getattr(owner, attr)
                if not isinstance(t, torch.Tensor) or t.numel() or str(t.dtype) != f"torch.{dtype}":
                    return False
    except Exception:  # noqa: BLE001 - not a skeleton this reader made right: load it
        return False
    return True


def _load(graph: bytes) -> torch.jit.ScriptModule:
    """``torch.jit.load`` of ``graph``, read from a file: from a buffer, torch 2.13 takes
    6-10x as long for a 200 MB model (1.2 s against 0.13 s here).  The file is a
    segment (tmpfs, named for this process, so a crash leaves nothing a sweep keeps)."""
    scratch = Segment.create(len(graph), populate=False)
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
            size += -(-st.nbytes() // _ALIGN) * _ALIGN
        offset = storages[st.data_ptr()][0] // t.element_size() + t.storage_offset()
        key = (str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()), offset)
        views.setdefault(key, []).append(path)
    entries = [(tuple(paths), *key) for key, paths in views.items()]
    return entries, list(storages.values()), size


def _write(segment: Segment, storages) -> None:
    with open(segment.path, "r+b") as f:
        for offset, raw in storages:
            f.seek(offset)
            f.write(memoryview(raw.numpy()))


class MappedWeights:
    """A worker's side: its copy-on-write mapping of one model's shared weights.

    Points every shared attribute of ``module`` at a view of the mapping.
    ``check()`` after each call of the model raises WeightWriteError if the call
    wrote to any of them (and restores them first).
    """

    def __init__(self, module: torch.jit.ScriptModule, name: str,
                 manifest: Sequence[Entry], core: int, model: int):
        self.name = name
        self.core = core
        self.model = model
        self.module_name = _module_name(module)
        self.manifest = tuple(tuple(e) for e in manifest)
        self.mm = Segment.map_copy(name)
        _populate(self.mm)
        # normal tensors, not inference tensors: only those keep a version counter
        with torch.inference_mode(False):
            self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
            for paths, dtype, shape, stride, offset in self.manifest:
                view = self.base.view(getattr(torch, dtype)).as_strided(shape, stride, offset)
                for path in paths:
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
        seg = Segment.attach(self.name)
        try:
            mine = memoryview(self.mm)
            out = []
            for paths, dtype, shape, stride, offset in self.manifest:
                lo, hi = _span(dtype, shape, stride, offset)
                if mine[lo:hi] != seg.buf[lo:hi]:
                    out.append(paths[0])
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
        mm.madvise(_MADV_POPULATE_READ)
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
