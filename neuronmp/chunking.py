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

Every caller that cuts batches (a traced call, dynamic_batch, DataParallel, the
BatchingServer) uses these functions, so the rules hold everywhere alike.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = ["split_sizes", "plan", "pad", "join", "strip"]


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
