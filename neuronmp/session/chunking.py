"""The one chunk plan: how a batch is cut for cores, padded to traced batches, and joined.

    DataParallel(batch of N rows, n cores)      split_sizes(N, n): divmod, the remainder
        │                                         spread one row at a time over the first
        ▼                                         chunks (the SDK's rule)
    model call with r rows (dynamic batching, traced batch b)
        │ plan(r, b, cores): ceil(r / b) traced batches, zero-padded, spread over the
        ▼                  model's cores: one message per core with its count of batches
    worker: runner(n, x) ─ one call of the inner graph when it takes any batch,
        │                  else n calls of b rows
        ▼
    join(parts) ─ concatenate per output ─ strip(rows): the padding goes

A model traced with batch buckets (one graph per batch size) is cut differently:

    model call with r rows, buckets (b1 < ... < bk)
        │ bucket_pieces(r, buckets, cores): r <= bk and one core: one piece; more cores
        ▼   than bk-row pieces: rows spread evenly, one piece per core; else bk-row
            pieces and the rest; each piece padded to the smallest bucket holding it
    worker: runner(1, piece) ─ the graph of that bucket

Every caller that cuts batches (a traced call, dynamic_batch, DataParallel, the
BatchingServer) uses these functions, so the rules hold everywhere alike.
DataParallel's chunks of whole traced batches go as row ranges of the caller's
tensors (``row_specs``, ``row_ranges``), cut and checked in one pass by the row
cutter, ``neuronmp.session._rowcut`` (C, this layer's: ``_rowcut.c``); the transport only
sends the row ranges it is handed (``ipc.codec.Rows``, under the contract of
``ipc/_tensor.h``), so the API layer never names the transport.
"""
from __future__ import annotations

import bisect
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..errors import BatchBucketsError
from ..ipc import codec as _codec
from . import _rowcut

__all__ = ["split_sizes", "plan", "pad", "join", "strip", "check_buckets", "fit",
           "bucket_pieces", "row_specs", "row_ranges"]


def split_sizes(size: int, n: int) -> Tuple[List[int], bool]:
    """Rows per chunk for ``n`` cores, and whether they are uneven (cores not fully used).

    ``divmod(size, n)``; the remainder goes one row at a time to the first chunks; a
    batch smaller than ``n`` uses ``size`` cores, one row each.
    """
    if size <= n:
        return ([1] * size if size else [0]), False
    per, extra = divmod(size, n)
    return [per + 1] * extra + [per] * (n - extra), bool(extra)


def plan(rows: int, batch: int, targets: int) -> Tuple[int, List[int]]:
    """(rows of padding, traced batches per target) for ``rows`` rows on ``targets`` cores.

    Whole traced batches of ``batch`` rows, the last one padded; each of the first
    ``min(targets, batches)`` cores gets a contiguous run of them.
    """
    chunks = -(-rows // batch)
    used = min(targets, chunks)
    per, extra = divmod(chunks, used)
    return chunks * batch - rows, [per + 1] * extra + [per] * (used - extra)


def pad(args: Sequence[torch.Tensor], rows: int) -> List[torch.Tensor]:
    """``args`` with ``rows`` zero rows appended along dim 0."""
    if not rows:
        return list(args)
    return [torch.cat([x, x.new_zeros((rows, *x.shape[1:]))]) for x in args]


def join(parts: Sequence[Sequence[torch.Tensor]], dim: int = 0) -> List[torch.Tensor]:
    """Per output, the parts' tensors concatenated along ``dim`` (in part order)."""
    if len(parts) == 1:
        return list(parts[0])
    return [torch.cat(group, dim) for group in zip(*parts)]


def strip(outs: Sequence[torch.Tensor], rows: int) -> List[torch.Tensor]:
    """The first ``rows`` rows of each output (the padding dropped)."""
    return [o[:rows] for o in outs]


def check_buckets(buckets: Any, batch: Optional[int], where: str = "neuronmp.trace"
                  ) -> Tuple[int, ...]:
    """``buckets`` as a tuple, or :class:`BatchBucketsError` saying what is wrong.

    Accepted: a list or tuple of ints >= 1, strictly increasing, that holds ``batch``
    (the traced example's batch size: its graph is traced on the example as given,
    the other buckets on the example's rows repeated or cut).
    """
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)):
        raise BatchBucketsError(buckets, f"is a {type(buckets).__name__}, not a list or "
                                "tuple of ints", where)
    if not buckets:
        raise BatchBucketsError(buckets, "is empty", where)
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise BatchBucketsError(buckets, f"holds {b!r}, not a batch size >= 1", where)
    for a, b in zip(buckets, buckets[1:]):
        if b <= a:
            raise BatchBucketsError(buckets, f"is not strictly increasing ({a} then {b})",
                                    where)
    if batch is None:
        raise BatchBucketsError(buckets, "needs inputs that share their dim-0 (batch) "
                                "size", where)
    if batch not in buckets:
        raise BatchBucketsError(buckets, f"does not hold the example's batch size {batch}",
                                where)
    return tuple(buckets)


def fit(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``rows`` rows (the largest when none does)."""
    return buckets[bisect.bisect_left(buckets, rows)] if rows <= buckets[-1] else buckets[-1]


def bucket_pieces(rows: int, buckets: Sequence[int], targets: int) -> List[Tuple[int, int]]:
    """``(rows, bucket)`` per piece, in order, for ``rows`` rows on ``targets`` cores.

    As few pieces as the largest bucket allows -- full largest buckets, then the
    rest in the smallest bucket that holds it (compute spent on padding is at most
    that last piece's) -- unless there are more cores than that: then the rows are
    spread evenly over ``min(targets, rows)`` pieces, one per core.
    """
    largest = buckets[-1]
    full, rest = divmod(rows, largest)
    if full + bool(rest) >= targets:
        sizes = [largest] * full + ([rest] if rest else [])
    else:
        sizes, _ = split_sizes(rows, min(targets, rows))
    return [(n, fit(n, buckets)) for n in sizes]


def row_specs(inputs: Sequence[Tuple[Sequence[int], torch.dtype]], batch: Optional[int]
              ) -> Optional[List[Tuple[int, Tuple[int, ...]]]]:
    """Per traced input ``(shape, dtype)``, the ``(dtype code, shape)`` that
    :func:`row_ranges` takes; None when some input cannot go as row ranges (no
    shared batch dimension, a dtype the codec lacks)."""
    if not batch:
        return None
    specs = []
    for shape, dtype in inputs:
        if not shape or dtype not in _codec.CODE:
            return None
        specs.append((_codec.CODE[dtype], tuple(shape)))
    return specs


def row_ranges(inputs: Sequence[Any], sizes: List[int],
               specs: Sequence[Tuple[int, Tuple[int, ...]]]) -> Optional[list]:
    """Per input, its chunks of ``sizes`` rows as row ranges of the input itself
    (sent without a view or a copy per chunk); None unless every input is a
    contiguous CPU tensor of its traced dtype and shape but for dim 0 (checked in
    the same pass, in C)."""
    if len(inputs) != len(specs):
        return None
    cut = _cut or _cutter()
    pieces = [cut(x, sizes, code, shape) for x, (code, shape) in zip(inputs, specs)]
    return None if None in pieces else pieces


def _cutter():
    """``_rowcut.rows``, set up with the codec's terms on first use."""
    global _cut
    if _cut is None:
        _rowcut.setup(*_codec.row_range_contract())
        _cut = _rowcut.rows
    return _cut


_cut = None
