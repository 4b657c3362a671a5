"""A batch's rows: the callers' inputs stacked and padded, the outputs split per caller.

    requests (single samples, or k rows each)
        │ assemble(batch, i, pad): input i as one stack (samples) or one cat (rows),
        ▼ zero rows appended to whole traced batches (a lone request: a view, no copy)
    one tensor per model input ─▶ the core ─▶ outputs of the whole padded batch
        │ values(batch, outs, total): each caller's rows, in the traced output
        ▼ structure (one split or unbind per output, not a slice per request)
    one value per request

One :class:`Rows` per server, made from its model: ``normalise`` checks a caller's
rows as they come, ``payload`` makes a batch what its core runs (whole traced
batches, or one bucket), ``values`` splits the answer, ``sizes_run`` says which batch
sizes the cores will see.  Used alike by the threads' path (threads.py) and every
event loop's (loop.py).  Its one state is the cache of accepted shapes; no locks.
"""
from __future__ import annotations

import operator
from typing import Any, List, Sequence, Tuple

import torch

from ..session import chunking, pytree
from .queue import Request
from .rowbytes import join_rows

__all__ = ["Rows"]

# per-request fields read in C (map), not a Python step per request
_single, _rows_of = operator.attrgetter("single"), operator.attrgetter("rows")
_raw_of = operator.attrgetter("raw")


class Rows:
    """Batch assembly and output split of a BatchingServer (see the module docstring)."""

    def __init__(self, model, batch_size: int, max_batch_size: int):
        self.model = model
        self.batch_size = batch_size
        self.max_batch_size = max_batch_size
        self.signature = model.signature.inputs
        self.accepted: dict = {}   # (shape, dtype) of a lone input -> (rows, single)
        self.spec = model.spec
        self.single_output = self.spec if isinstance(self.spec, int) else None
        # padding rows: less than a traced batch, or than the largest bucket
        pad_rows = model.buckets[-1] if model.buckets else batch_size
        self.padding = [torch.zeros((pad_rows, *shape[1:]), dtype=dtype)
                        for shape, dtype in self.signature]

    def payload(self, batch: List[Request]) -> Tuple[list, int, int, Any]:
        """(the batch's inputs padded, its rows padded, how many traced batches: one
        for a bucketed model, whose bucket is counted as run, and where the answer
        goes: a lone unpadded request's own ``into``, else None)."""
        rows = sum(map(_rows_of, batch))
        if self.model.buckets:   # one piece: a batch never takes past the largest
            total, count = self.model.bucket_for(rows), 1
        else:
            pad, _ = chunking.plan(rows, self.batch_size, 1)
            total = rows + pad
            count = total // self.batch_size
        pad = total - rows
        args = join_rows(batch, total, pad) if any(map(_raw_of, batch)) else None
        if args is None:
            args = [self.assemble(batch, i, pad) for i in range(len(self.signature))]
        into = batch[0].into if len(batch) == 1 and not pad else None
        return args, total, count, into

    def assemble(self, batch: List[Request], i: int, pad: int) -> torch.Tensor:
        """Input ``i`` of the batch: one stack of single samples (the usual case) or
        one cat of rows, zero-padded (always less than one traced batch)."""
        if len(batch) == 1 and not pad:
            # a view: the ring copies it anyway, and a copy of a large input here runs
            # on torch's intra-op threads, which then spin on the caller's CPUs
            req = batch[0]
            return req.inputs[i].unsqueeze(0) if req.single else req.inputs[i]
        if all(map(_single, batch)):
            parts = [r.inputs[i] for r in batch]
            if pad:
                parts.extend([self.padding[i][0]] * pad)
            return torch.stack(parts)
        parts = [r.inputs[i].unsqueeze(0) if r.single else r.inputs[i] for r in batch]
        if pad:
            parts.append(self.padding[i][:pad])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def values(self, batch: List[Request], outs: List[torch.Tensor], total: int) -> list:
        """Each request's rows of a batch's outputs, in the traced output structure."""
        for o in outs:
            if o.dim() == 0 or o.shape[0] != total:
                raise ValueError(
                    f"BatchingServer: the model returned an output of shape {list(o.shape)} "
                    f"for a batch of {total} rows; served models must keep the batch in "
                    "dim 0 of every output"
                )
        start, single_out, spec = 0, self.single_output, self.spec
        if len(batch) > 1 and not any(map(_single, batch)):
            return self._split(batch, outs, total)
        rows_of = None  # per output, its rows as views: one call instead of one per row
        values = []
        for req in batch:
            if req.single:
                if rows_of is None:
                    rows_of = [o.unbind(0) for o in outs]
                value = rows_of[single_out][start] if single_out is not None else \
                    pytree.unflatten([r[start] for r in rows_of], spec)
            else:
                flat = [o[start:start + req.rows] for o in outs]
                value = flat[single_out] if single_out is not None else pytree.unflatten(flat, spec)
            start += req.rows
            values.append(value)
        return values

    def _split(self, batch: List[Request], outs: List[torch.Tensor], total: int) -> list:
        """``values`` for requests of rows: one split per output, not a slice per request."""
        sizes = list(map(_rows_of, batch))
        rows = sum(sizes)
        if rows < total:
            sizes.append(total - rows)   # the padding, dropped
        # the C method: Tensor.split's Python wrapper costs as much again per batch
        parts = [o.split_with_sizes(sizes) for o in outs]
        if self.single_output is not None:
            return list(parts[self.single_output][:len(batch)])
        return [pytree.unflatten([p[k] for p in parts], self.spec) for k in range(len(batch))]

    def normalise(self, inputs: Sequence[torch.Tensor]) -> Tuple[tuple, int, bool]:
        """(inputs, rows, single) or a clear error naming the bad input (single
        samples keep their shape; a batch stacks them).  A lone CPU tensor of a
        shape and dtype accepted before is not checked again (serving callers send
        the same few shapes; docs/performance.md, "The batching
        server")."""
        if len(inputs) == 1:
            x = inputs[0]
            if type(x) is torch.Tensor and x.is_cpu:
                key = (x.shape, x.dtype)
                hit = self.accepted.get(key)
                if hit is not None:
                    return inputs, hit[0], hit[1]
                got = self.model.signature.request(inputs, self.max_batch_size,
                                                   "BatchingServer")
                if len(self.accepted) < 64:
                    self.accepted[key] = got[1:]
                return got
        return self.model.signature.request(inputs, self.max_batch_size, "BatchingServer")

    def sizes_run(self) -> List[int]:
        """The batch sizes the cores will see: the traced batch (a padded batch is
        whole traced batches of one graph), or each bucket a batch of up to
        ``max_batch_size`` rows may be padded to."""
        buckets = self.model.buckets
        if not buckets:
            return [self.batch_size]
        return [b for b in buckets if b <= chunking.fit(self.max_batch_size, buckets)]
