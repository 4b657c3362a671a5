"""What a rank says it is calling, in each of its arrivals: the collective, its dtype
and element count, its root and reduce op -- or that it refused its own arguments.

    group.py   calls.of("all_reduce", n, dtype, root, redop) ─▶ ShmGroup.announce(call)
    shm.py     every arrival writes the call beside its counter (one of two areas by
               the arrival's parity), then compares every peer's with its own
    mismatch   every rank read the same calls: every rank raises the same
               CollectiveMismatchError, naming each rank's call

A call is CALL_BYTES bytes: one word of codes (the collective, the dtype, the reduce
op, the root + 1), the element count, a flags word, and the start of a refusal's
reason.  The codes are indexes into tables every rank builds alike (the ranks of one
group run one torch).
"""
from __future__ import annotations

import collections
import struct
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import CollectiveMismatchError

#: bytes of one announced call
CALL_BYTES = 128
_HEAD = struct.Struct("<QQQ")
_REASON = CALL_BYTES - _HEAD.size
_REFUSED = 1

# every collective a rank may announce, in a fixed order: its index is the code
NAMES = ("init_process_group", "barrier", "all_reduce", "all_reduce_coalesced", "reduce",
         "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
         "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
         "all_to_all_single")
_CODE = {name: i + 1 for i, name in enumerate(NAMES)}
_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_RED = dist.ReduceOp.RedOpType


_MADE: Dict[tuple, bytes] = {}   # a training step announces the same few calls


def of(name: str, numel: int = 0, dtype: Optional[torch.dtype] = None,
       root: Optional[int] = None, redop: Optional[int] = None) -> bytes:
    """The announced form of a call (``redop``: a ReduceOp's kind as an int)."""
    key = (name, numel, dtype, root, redop)
    call = _MADE.get(key)
    if call is None:
        if len(_MADE) >= 4096:
            _MADE.clear()
        call = _MADE[key] = _pack(name, numel, dtype, root, redop, 0, b"")
    return call


def refused(name: str, reason: str) -> bytes:
    """The announced form of a call this rank refused (``reason``: why, abridged)."""
    return _pack(name, 0, None, None, None, _REFUSED, reason.encode()[:_REASON])


def _pack(name, numel, dtype, root, redop, flags, reason) -> bytes:
    codes = (_CODE[name] | _DTYPE_CODE.get(dtype, 0) << 8
             | (0 if redop is None else int(redop) + 1) << 16
             | (0 if root is None else root + 1) << 24)
    return _HEAD.pack(codes, numel, flags) + reason.ljust(_REASON, b"\0")


def describe(call: bytes) -> Dict[str, object]:
    """A call as its fields: op, numel, dtype, root, reduce_op, refused (or None)."""
    codes, numel, flags = _HEAD.unpack_from(call)
    name, dtype, red, root = codes & 0xFF, codes >> 8 & 0xFF, codes >> 16 & 0xFF, codes >> 24
    reason = call[_HEAD.size:].rstrip(b"\0").decode(errors="replace")
    return {"op": NAMES[name - 1] if 0 < name <= len(NAMES) else f"unknown ({name})",
            "numel": numel,
            "dtype": str(_DTYPES[dtype - 1]) if 0 < dtype <= len(_DTYPES) else None,
            "root": root - 1 if root else None,
            "reduce_op": _RED(red - 1).name if red else None,
            "refused": reason if flags & _REFUSED else None}


def is_refused(call: bytes) -> bool:
    return bool(_HEAD.unpack_from(call)[2] & _REFUSED)


def mismatch(op: str, calls: Sequence[bytes]) -> CollectiveMismatchError:
    """The error every rank raises when the ranks' calls differ (``calls`` by rank,
    the same list on every rank): the ranks named as differing are those whose call
    is not the most common one (of calls as common, the lowest rank's)."""
    counts = collections.Counter(calls)
    usual = max(calls, key=lambda c: (counts[c], -calls.index(c)))
    differ: List[int] = [r for r, c in enumerate(calls) if c != usual]
    return CollectiveMismatchError(op, [describe(c) for c in calls], differ)
