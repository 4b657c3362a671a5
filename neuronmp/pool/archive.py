"""A ``torch.jit.save`` archive's weights, read without loading it.

    graph bytes (a zip) ─▶ <archive>/data.pkl: which attribute views which storage
                        ─▶ <archive>/data/<key>: each storage, a stored (uncompressed) entry
    split(graph) ─▶ Split(skeleton, entries, plan, size)
                    skeleton: the archive with those entries empty and data.pkl rewritten
                              so each shared attribute is an empty tensor of its dtype
                    plan:     (offset in the segment, (start, length) in graph) per storage

torch.jit.load of a 200 MB graph (a copy into fresh pages, after another into a
scratch file) was most of a model's load on 32 cores; reading these two needs no
load.  data.pkl is followed opcode by opcode (pickletools) without building any
torch object; anything this reader does not model raises, and the caller
(pool/weights.py) loads the graph instead, with the same result, slower.
"""
from __future__ import annotations

import io
import pickletools
import struct
import zipfile
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ..host import _torchscript

ALIGN = 64  # every storage starts on a cache line (and so at any dtype's alignment)


class Split(NamedTuple):
    """What :func:`split` found: the skeleton a core loads, the manifest entries
    (attribute paths, dtype, shape, stride, offset in elements), where each storage's
    bytes go, and the segment's size."""

    skeleton: bytes
    entries: Tuple[tuple, ...]
    plan: Tuple[Tuple[int, Tuple[int, int]], ...]
    size: int


def owner_and_attr(module: torch.jit.ScriptModule, path: str):
    """The module that holds attribute ``path`` (dotted) of ``module``, and its name."""
    *parts, attr = path.split(".")
    for p in parts:
        module = getattr(module, p)
    return module, attr



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


def split(graph) -> Optional[Split]:
    """The weights of ``graph`` (``torch.jit.save`` bytes) and its skeleton, without
    loading it; None when there is nothing to share or the skeleton does not check
    out.  Raises on an archive this reader does not follow (the caller loads it)."""
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
        size += -(-st.numel * itemsize // ALIGN) * ALIGN
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
    return Split(skeleton, tuple(entries), tuple(plan), size)


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
                owner, attr = owner_and_attr(module, path)
                t = getattr(owner, attr)
                if not isinstance(t, torch.Tensor) or t.numel() or str(t.dtype) != f"torch.{dtype}":
                    return False
    except Exception:  # noqa: BLE001 - not a skeleton this reader made right: load it
        return False
    return True
