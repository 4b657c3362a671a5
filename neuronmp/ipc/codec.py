"""Frame encoding: a pytree of tensors as one contiguous record of bytes.

    record (64-byte aligned, written in place in a ring or a spill segment)
    +--------------------------------------+ 0
    | length u32 | kind u32 | n u32 | s u32 |   REC: total bytes, layout kind,
    +--------------------------------------+ 16    tensor count, skeleton bytes
    | dtype u8 | ndim u8 | data_off u64 | shape i64 * ndim |   one per tensor
    +--------------------------------------+
    | skeleton (pickle, tensors as persistent ids) or spill segment name |
    +--------------------------------------+ aligned to 64
    | tensor 0 raw bytes | pad | tensor 1 raw bytes | ...   (each 64-aligned)
    +--------------------------------------+ length

The common shapes of a request or a response -- one tensor, a tuple or a list
of tensors -- need no skeleton: ``kind`` says how to rebuild them.  Small
trees of tuples and lists holding tensors, ints, floats, bools, None, str and
bytes (the pool's ``(op, id, model, (tensor, ...))``) are PACKED: a compact
tag skeleton.  Both are encoded and decoded in one C call (``_frames.put`` /
``_frames.get`` / ``_frames.decode``), which also builds the received tensors
through DLPack.  Anything else (dicts, other objects, tensors that need
``_prepare``) is planned and written here, pickled with the tensors pulled
out as persistent ids, so their bytes are never pickled.

    PACKED skeleton tags: N None, T True, F False, i int64, d float64,
    s str (u32 length + UTF-8), b bytes (u32 length + bytes),
    t tuple / l list (u32 count + items), X the next tensor
"""
from __future__ import annotations

import io
import math
import pickle
import struct
import warnings
from typing import Any, List, Tuple

import torch

from . import _frames

PAD, TENSOR, TUPLE, LIST, PICKLED, SPILL, PACKED, ARENA = range(8)

REC = struct.Struct("<IIII")
_DESC_HEAD = struct.Struct("<BB6xQ")
_MAX_NDIM = 64
_SHAPES = [struct.Struct(f"<{n}q") for n in range(_MAX_NDIM + 1)]
_DESCS = [struct.Struct(f"<BB6xQ{n}q") for n in range(_MAX_NDIM + 1)]
ALIGN = 64
_COPY_VIA_BYTES = 1 << 16  # below this a bytearray copy beats torch.empty + memcpy

# Stable wire codes: the index in this list (names absent from this torch are skipped
# without shifting the others).
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)
DTYPES = {}
_CODE = {}
_ITEMSIZE = {}
CODE = _CODE
for _code, _name in enumerate(_DTYPE_NAMES):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPES[_code] = _dt
        _CODE[_dt] = _code
        _ITEMSIZE[_code] = _dt.itemsize
del _code, _name, _dt

_Tensor = torch.Tensor
_frombuffer = torch.frombuffer
_empty = torch.empty
_copy_in = _frames.copy_in
_copy_out = _frames.copy_out
_decode = _frames.decode
_C_KINDS = frozenset((TENSOR, TUPLE, LIST, PACKED))
_DL_COMPLEX = 5   # DLPack's kDLComplex: the conj bit is not carried


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Plan:
    """What ``write`` will put down: computed once, so the size is known before any copy."""

    __slots__ = ("length", "kind", "tensors", "metas", "skel")

    def __init__(self, length, kind, tensors, metas, skel):
        self.length = length
        self.kind = kind
        self.tensors = tensors
        self.metas = metas  # (code, shape, data_off, nbytes) per tensor
        self.skel = skel


class Rows(tuple):
    """A row range: rows ``[start, start + count)`` of dim 0 of a tensor, sent as a
    tensor of those rows: ``(description, tensor, start, count)``.

    The transport only sends row ranges; the request path makes them (DataParallel's
    cutter, ``neuronmp.session._rowcut`` through ``chunking.row_ranges``).  The description
    is a capsule under the contract of ``ipc/_tensor.h``; the C codec copies it (taken
    once for all of a tensor's row ranges) instead of asking torch per range, and
    makes no view.  A Rows whose description does not meet that contract is sent as
    the view :meth:`tensor`, on the pickle path, as it is anywhere else.  The tensor
    must not be resized while its rows are in flight, as no input may be during a
    call.
    """

    __slots__ = ()

    def tensor(self) -> torch.Tensor:
        return self[1].narrow(0, self[2], self[3])


def row_range_contract() -> tuple:
    """What a row cutter needs of the codec to make row ranges it sends as they are
    (the arguments of ``neuronmp.session._rowcut.setup``): the tensor type, ``{dtype: code}``,
    ``{code: item size}``, the codes whose conj bit must be asked, ``torch.strided``
    and :class:`Rows`."""
    dl = _dlpack_types()
    ask_conj = tuple(code for code in DTYPES if code not in dl or dl[code][0] == _DL_COMPLEX)
    return _Tensor, dict(_CODE), dict(_ITEMSIZE), ask_conj, torch.strided, Rows


def _prepare(t: torch.Tensor) -> torch.Tensor:
    """A CPU, dense, contiguous tensor whose memory holds exactly its values."""
    if t.layout is not torch.strided:
        raise TypeError(f"Cannot send a {t.layout} tensor on a ring: expected a dense "
                        "(strided) tensor; call .to_dense() first")
    if t.dtype not in _CODE:
        raise TypeError(f"Cannot send a tensor of dtype {t.dtype} on a ring: expected one of "
                        + ", ".join(str(d) for d in DTYPES.values()))
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def _flatten(obj: Any) -> Tuple[int, List[torch.Tensor], bytes]:
    tp = type(obj)
    if tp is _Tensor:
        return TENSOR, [obj], b""
    if tp is tuple or tp is list:
        for x in obj:
            if type(x) is not _Tensor:
                break
        else:
            return (TUPLE if tp is tuple else LIST), list(obj), b""
    tensors: List[torch.Tensor] = []

    def persistent_id(o):
        if type(o) is Rows:
            o = o.tensor()
        if isinstance(o, _Tensor):
            tensors.append(o)
            return len(tensors) - 1
        return None

    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
    p.persistent_id = persistent_id
    try:
        p.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(
            f"Cannot send {tp.__name__} on a ring: expected tensors, tuples, lists and dicts "
            f"of them, and small picklable values ({exc})") from exc
    return PICKLED, tensors, f.getvalue()


def plan(obj: Any) -> Plan:
    """Lay out ``obj``: tensors made contiguous, every offset fixed."""
    kind, tensors, skel = _flatten(obj)
    off = REC.size + len(skel)
    for i, t in enumerate(tensors):
        if not t.is_contiguous() or t.is_neg() or t.is_conj() or not t.is_cpu:
            t = tensors[i] = _prepare(t)
        off += 16 + 8 * t.dim()
    off = align(off)
    metas = []
    for t in tensors:
        try:
            code = _CODE[t.dtype]
        except KeyError:
            _prepare(t)  # raises the clear error
            raise
        shape = t.shape
        if len(shape) > _MAX_NDIM:
            raise ValueError(f"Cannot send a {len(shape)}-d tensor: at most {_MAX_NDIM} dims")
        n = t.nbytes
        metas.append((code, shape, off, n))
        off = align(off + n)
    return Plan(off, kind, tensors, metas, skel)


def spill_plan(name: str, kind: int = SPILL) -> Plan:
    """The small record standing in for a frame that travels on another segment:
    a one-off one (SPILL) or the writer's reused one (ARENA)."""
    skel = name.encode()
    return Plan(align(REC.size + len(skel)), kind, [], [], skel)


def write(mm, base: int, p: Plan) -> None:
    """Write the record of ``p`` at byte ``base`` of the mapping ``mm``."""
    pos = base + REC.size
    for (code, shape, data_off, n), t in zip(p.metas, p.tensors):
        nd = len(shape)
        _DESCS[nd].pack_into(mm, pos, code, nd, data_off, *shape)
        pos += 16 + 8 * nd
        if n:
            _copy_in(mm, base + data_off, t.data_ptr(), n)
    if p.skel:
        mm[pos:pos + len(p.skel)] = p.skel
    REC.pack_into(mm, base, p.length, p.kind, len(p.tensors), len(p.skel))


def read(mm, base: int, copy: bool) -> Tuple[int, Any]:
    """Rebuild the frame at ``base``: ``(kind, value)``; SPILL and ARENA give a segment name.

    With ``copy`` the tensors own their memory; otherwise they are views of ``mm``.
    """
    _, kind, ntensors, skel_len = REC.unpack_from(mm, base)
    if kind in _C_KINDS:   # tensors, tuples and lists of them, packed trees: the C decoder
        return kind, _decode(mm, base, copy)
    if kind not in (PICKLED, SPILL, ARENA):
        raise ValueError(f"corrupt ring record: kind {kind}")
    pos = base + REC.size
    tensors = []
    for _ in range(ntensors):
        code, nd, data_off = _DESC_HEAD.unpack_from(mm, pos)
        shape = _SHAPES[nd].unpack_from(mm, pos + 16)
        pos += 16 + 8 * nd
        tensors.append(_tensor(mm, base + data_off, DTYPES[code], _ITEMSIZE[code], shape, copy))
    skel = bytes(mm[pos:pos + skel_len])
    if kind != PICKLED:
        return kind, skel.decode()
    up = pickle.Unpickler(io.BytesIO(skel))
    up.persistent_load = tensors.__getitem__
    return kind, up.load()


def _make(mm, off: int, code: int, shape: tuple, copy: bool) -> torch.Tensor:
    """The C decoder's fallback for dtypes DLPack does not carry (bits*)."""
    return _tensor(mm, off, DTYPES[code], _ITEMSIZE[code], shape, copy)


def _dlpack_types() -> dict:
    """{code: (DLPack type code, bits, lanes)}, read from torch's own capsules."""
    out = {}
    for code, dt in DTYPES.items():
        try:
            with warnings.catch_warnings():  # "ComplexHalf support is experimental"
                warnings.simplefilter("ignore")
                cap = torch._C._to_dlpack(_empty(1, dtype=dt))
        except Exception:  # noqa: BLE001 -- e.g. BufferError "Bit types are not supported"
            continue
        out[code] = _frames.dl_dtype(cap)
        del cap  # unconsumed: its destructor frees the tensor
    return out


def setup_fast_path(ring_layout: Tuple[int, ...]) -> None:
    """Hand the C codec torch's types and the ring header layout (once per process)."""
    _frames.setup(_Tensor, dict(_CODE), dict(_ITEMSIZE), _dlpack_types(), torch.strided,
                torch._C._from_dlpack, _make, tuple(ring_layout), Rows)


def _tensor(mm, off, dtype, itemsize, shape, copy):
    numel = math.prod(shape)
    n = numel * itemsize
    if n == 0:
        return _empty(shape, dtype=dtype)
    if not copy:
        t = _frombuffer(mm, dtype=dtype, count=numel, offset=off)
    elif n < _COPY_VIA_BYTES:
        t = _frombuffer(bytearray(mm[off:off + n]), dtype=dtype)
    else:
        t = _empty(shape, dtype=dtype)
        _copy_out(mm, off, t.data_ptr(), n)
        return t
    return t if len(shape) == 1 else t.view(shape)
