"""Requests given as bytes: the HTTP front end's binary requests of a one-input model.

    front end ─▶ RowInput.submit(body bytes, waiter) ─▶ the server's queues (a Request
                 whose ``raw`` is its RowInput; checked once per kind, not per request)
    Rows.payload ─▶ join_rows: one tensor on the batch's joined bytes (a mixed
                 batch: each request's bytes become its tensor, the usual path)
    loop.py's answer ─▶ rows_view: the one output as bytes ─▶ each RowsWaiter.set_rows
                 with its rows' slice (no asyncio future, done callback or tensor per
                 request)
"""
from __future__ import annotations

import asyncio
import warnings
from typing import Any, Optional

import torch

from .queue import Request

__all__ = ["RowInput", "RowsWaiter", "join_rows", "rows_view"]


class RowsWaiter:
    """The waiter of a request sent by :meth:`RowInput.submit`, in place of an asyncio
    future: the batch's answer calls it directly, on the loop (no future, no done
    callback, no handle per request).  ``set_rows`` is the usual answer; ``set_result``
    (the model's value for these rows) when its batch could not be answered as bytes;
    ``set_exception`` when it failed.  Exactly one of them is called, once ``done()``
    is False; they must not raise."""

    __slots__ = ()

    def done(self) -> bool:
        raise NotImplementedError

    def set_rows(self, view: memoryview, out: torch.Tensor, start: int, rows: int) -> None:
        """``view``: this request's rows of ``out`` (the batch's one output), as bytes;
        they are ``out[start:start + rows]``."""
        raise NotImplementedError

    def set_result(self, value: Any) -> None:
        raise NotImplementedError

    def set_exception(self, exc: BaseException) -> None:
        raise NotImplementedError


class RowInput:
    """Requests of a model with one input, each given as that input's bytes (``shape``
    and ``dtype``, the batch dimension first), checked once here rather than per
    request, and batched by joining the bytes (one tensor per batch, not one per
    request): the HTTP front end's binary requests.  Raises as
    ``BatchingServer.submit`` would for such an input, or ValueError when the model
    does not take exactly one input with a batch dimension."""

    def __init__(self, server, shape, dtype: torch.dtype, priority: Optional[int] = None,
                 timeout: Any = None, has_timeout: bool = False):
        signature = server._rows.signature
        if len(signature) != 1:
            raise ValueError(f"RowInput serves models of one input, not {len(signature)}")
        _, rows, single = server._rows.normalise([torch.zeros(shape, dtype=dtype)])
        if single:
            raise ValueError(f"RowInput needs the batch dimension: shape {list(shape)}")
        self.server = server
        self.rows = rows
        self.dtype = dtype
        self.row_shape = tuple(shape[1:])
        self.nbytes = rows * dtype.itemsize * _numel(self.row_shape)
        self.key = (dtype, self.row_shape)
        self.level = server._level(priority)
        self.policy = server._policies[self.level]
        self.timeout = timeout if has_timeout else self.policy.timeout
        pad_rows = server._rows.padding[0].shape[0]
        self._zeros = memoryview(bytes(pad_rows * self.nbytes // max(rows, 1)))

    def submit(self, loop: asyncio.AbstractEventLoop, data: memoryview,
               waiter: RowsWaiter) -> bool:
        """Queue ``data`` (``nbytes`` bytes, read-only, not copied until the batch is
        stacked) on ``loop`` (called on it: that loop forms its batches); False,
        with nothing done, once the server is closed.  Raises as ``submit`` does
        (QueueFullError)."""
        driver = self.server._loop_driver(loop)
        if driver is None:
            return False
        req = Request((data,), self.rows, False, self.timeout, waiter, self.level)
        req.raw = self
        driver.submit(req, self.policy)
        return True

    def tensor(self, data: memoryview) -> torch.Tensor:
        return torch.frombuffer(data, dtype=self.dtype).view(self.rows, *self.row_shape)

    def zeros(self, rows: int) -> memoryview:
        return self._zeros[:rows * self.nbytes // self.rows]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def join_rows(batch: list, total: int, pad: int) -> Optional[list]:
    """A batch of RowInput requests of one kind as one tensor on their joined bytes;
    None for a mixed batch, whose requests' bytes become tensors (the usual path)."""
    key = batch[0].raw.key if batch[0].raw is not None else None
    if key is not None and all(r.raw is not None and r.raw.key == key for r in batch):
        raw = batch[0].raw
        parts = [r.inputs[0] for r in batch]
        if pad:
            parts.append(raw.zeros(pad))
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return [torch.frombuffer(data, dtype=raw.dtype).view(total, *raw.row_shape)]
    for r in batch:
        if r.raw is not None:
            r.inputs = (r.raw.tensor(r.inputs[0]),)
            r.raw = None
    return None


def rows_view(out: Any, total: int) -> Optional[memoryview]:
    """The batch's one output as bytes (checked as ``Rows.values`` checks it), or None
    when it cannot be viewed so (not a contiguous tensor numpy can view)."""
    if type(out) is not torch.Tensor or not out.is_contiguous():
        return None
    if out.dim() == 0 or out.shape[0] != total:
        return None   # Rows.values names the mistake
    try:
        return memoryview(out.numpy()).cast("B")
    except (TypeError, RuntimeError):   # bfloat16, or a tensor that needs grad
        return None


def _spend_torch_warning() -> None:
    """torch warns once per process that a tensor on read-only bytes could write into
    them; a batch of RowInput requests is such a tensor, never written (the ring
    copies it), so the one warning is spent here rather than on a first batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_spend_torch_warning()
