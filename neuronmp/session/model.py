"""Loaded models and the one request path every caller takes.

    traced call ─┐
    dynamic_batch ┤                         Model.submit(args, replica=None) -> Answer
    DataParallel ─┼──▶ Signature.check  ──▶ chunking.plan: whole traced batches,
    BatchingServer┘    (one check)          padded, spread over the model's cores
                                            │
                                            ▼ one message per core
                           session.pool.call(core, pool id, (n_batches, *inputs))
                                            │
    Answer (joined over cores, padding stripped) ◀─ worker's runner(n, *inputs)

A model traced with batch buckets (a graph per batch size) takes the other plan:
``chunking.bucket_pieces`` cuts the call into pieces, each padded to the smallest
bucket that holds it and sent as one message; the worker runs that bucket's graph.

The API layer reaches the pool through this module and the session alone: the
answer types it hands out (``Answer``, a ``Destination`` for outputs) are
re-exported here, DataParallel's chunks go through :func:`run_chunks`, and a
batcher that forms its own batches sends each through a :class:`Route` (one call,
``Route.send``, whether the batcher is a thread or an event loop).

A :class:`Model` is one traced graph (bytes, signature, output spec) and its
placement wish.  Where it is loaded now -- local cores, pool model ids -- is the
session's (:class:`~neuronmp.session.session.Loaded`): after a runtime restart or in a
forked child the record is dead and the model loads again under the current
runtime, as placed before.  The handle table maps the integer a traced wrapper
carries (TorchScript can hold only an int) to its Model; a model lives as long as
the wrapper's graph tensor.
"""
from __future__ import annotations

import collections
import itertools
import json
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import BatchBucketsError
from ..host import devicetime, settings
from ..pool.answer import Answer, Destination, Joint, Pending, gather
from ..pool.loopchannel import LoopAnswer, Timer
from ..pool.pacing import answers_read_ahead, wakes_deferred
from . import chunking, coreuse
from . import session as _session

__all__ = ["Model", "Route", "Signature", "attach", "get", "is_traced", "model_of", "models_in",
           "new_model", "run_chunks", "wrappers_in"]

#: attribute names on the scripted wrapper (see tracing.py's generated source)
HANDLE_ATTR = "nmp_handle"
GRAPH_ATTR = "nmp_graph"
META_ATTR = "nmp_meta"
DYNAMIC_ATTR = "dynamic_batch"

_handles: Dict[int, Model] = {}
_ids = itertools.count(1)


class Signature:
    """A traced model's inputs (shape, dtype each), and the one check of a call's inputs."""

    __slots__ = ("inputs", "batch")

    def __init__(self, inputs: Sequence[Tuple[Sequence[int], str]], batch: Optional[int]):
        self.inputs: Tuple[Tuple[torch.Size, torch.dtype], ...] = tuple(
            (torch.Size(shape), getattr(torch, dtype)) for shape, dtype in inputs)
        self.batch = batch

    def exact(self, args: Sequence[Any]) -> bool:
        """Whether ``args`` are tensors of exactly the traced shapes and dtypes."""
        if len(args) != len(self.inputs):
            return False
        for x, (shape, dtype) in zip(args, self.inputs):
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.shape != shape \
                    or not x.is_cpu:
                return False
        return True

    def rows(self, args: Sequence[Any]) -> Optional[int]:
        """The dim-0 size ``args`` share when they are CPU tensors of the traced dtypes
        and shapes but for dim 0; else None (``check`` says what is wrong)."""
        if len(args) != len(self.inputs):
            return None
        rows = None
        for x, (shape, dtype) in zip(args, self.inputs):
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or not x.is_cpu or \
                    x.dim() != len(shape) or not shape or x.shape[1:] != shape[1:]:
                return None
            if rows is None:
                rows = x.shape[0]
            elif x.shape[0] != rows:
                return None
        return rows

    def check(self, args: Sequence[Any], dynamic: bool, who: str = "neuronmp traced model"
              ) -> Optional[int]:
        """None for exactly the traced inputs; the batch size when dynamic batching must
        cut it; else a TypeError/ValueError naming the input and the mismatch."""
        if self.exact(args):
            return None
        self._check_kinds(args, who)
        if not dynamic:
            for i, (x, (shape, _)) in enumerate(zip(args, self.inputs)):
                if x.shape != shape:
                    raise ValueError(
                        f"{who} input {i} has shape {list(x.shape)}, but the model was "
                        f"traced with {list(shape)}; a traced model's input shapes are fixed "
                        "(neuronmp.dynamic_batch() lets dim 0 vary)")
            return None
        return self._rows(args, "dynamic batching")

    def _check_kinds(self, args: Sequence[Any], who: str) -> None:
        if len(args) != len(self.inputs):
            raise TypeError(f"{who} takes {len(self.inputs)} input tensor(s) "
                            f"({self.describe()}), but got {len(args)}")
        for i, (x, (_, dtype)) in enumerate(zip(args, self.inputs)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{who} input {i} must be a torch.Tensor, "
                                f"got {type(x).__name__}")
            if x.device.type != "cpu":
                raise ValueError(f"{who} input {i} is on {x.device}; traced models "
                                 "consume CPU tensors")
            if x.dtype != dtype:
                raise ValueError(
                    f"{who} input {i} has dtype {_dt(x.dtype)}, but the model was traced "
                    f"with {_dt(dtype)}; a traced model's data types are fixed")

    def _rows(self, args: Sequence[torch.Tensor], who: str) -> int:
        rows = args[0].shape[0] if args[0].dim() else None
        for i, (x, (shape, _)) in enumerate(zip(args, self.inputs)):
            if x.dim() != len(shape) or x.shape[1:] != shape[1:]:
                raise ValueError(
                    f"{who}: input {i} has shape {list(x.shape)}, but the model "
                    f"was traced with {list(shape)}; only dimension 0 may differ")
            if x.shape[0] != rows:
                raise ValueError(f"{who} needs the same dim-0 size for every input, "
                                 f"got {[a.shape[0] for a in args]}")
        if not rows:
            raise ValueError(f"{who}: the batch is empty (shape {list(args[0].shape)})")
        return rows

    def request(self, inputs: Sequence[Any], max_rows: int, who: str
                ) -> Tuple[tuple, int, bool]:
        """A served request: ``(inputs, rows, single)`` -- one sample (no batch
        dimension) or ``1 <= k <= max_rows`` rows of each input.

        No torch op runs here: each one releases the GIL, and under load a caller
        that lets the GIL go waits for it again behind every other caller."""
        if len(inputs) != len(self.inputs):
            raise TypeError(f"{who}: the model takes {len(self.inputs)} input tensor(s) "
                            f"({self.describe()}), got {len(inputs)}")
        x0 = inputs[0]
        single = isinstance(x0, torch.Tensor) and x0.dim() == len(self.inputs[0][0]) - 1
        rows = None
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self.inputs)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{who}: input {i} must be a torch.Tensor, "
                                f"got {type(x).__name__}")
            if x.dtype != dtype or x.device.type != "cpu":
                raise ValueError(f"{who}: input {i} is a {x.device.type} {_dt(x.dtype)} "
                                 f"tensor; the model takes CPU {_dt(dtype)}")
            k = _request_rows(x, shape, single)
            if k is None:
                sample = list(shape[1:])
                raise ValueError(
                    f"{who}: input {i} has shape {list(x.shape)}; expected one sample "
                    f"{sample} or a batch [k, {', '.join(map(str, sample))}] with "
                    f"1 <= k <= {max_rows}, like every other input")
            if rows is not None and k != rows:
                raise ValueError(f"{who}: inputs have different batch sizes "
                                 f"{[a.shape[0] for a in inputs[:i + 1]]}")
            rows = k
        if not 1 <= rows <= max_rows:
            raise ValueError(f"{who}: a request of {rows} rows does not fit max_batch_size="
                             f"{max_rows}; send 1..{max_rows} rows per request")
        return tuple(inputs), rows, single

    def describe(self) -> str:
        """The traced inputs, as error messages name them: ``[1, 4] float32, ...``."""
        return ", ".join(f"{list(s)} {_dt(d)}" for s, d in self.inputs)


def _request_rows(x: torch.Tensor, shape: torch.Size, single: bool) -> Optional[int]:
    if single:
        return 1 if x.shape == shape[1:] else None
    if x.dim() == len(shape) and x.shape[1:] == shape[1:]:
        return x.shape[0]
    return None


class Model:
    """One traced graph loaded in this process: signature, output spec, placement."""

    def __init__(self, graph: Union[bytes, memoryview], meta: Dict[str, Any],
                 dynamic: bool = False):
        self.handle = next(_ids)
        self.graph = graph
        self.meta = meta
        self.signature = Signature(meta["inputs"], meta.get("batch"))
        self.batch: Optional[int] = meta.get("batch")
        self.spec = meta["outputs"]
        self.dynamic = bool(dynamic)
        #: batch sizes with a graph of their own (``trace(batch_buckets=...)``), or ()
        self.buckets: Tuple[int, ...] = tuple(meta.get("batch_buckets") or ())
        #: pieces sent per bucket, counted by this process (which graph each call ran)
        self.bucket_runs: collections.Counter = collections.Counter()
        self._runs_lock = threading.Lock()
        # resolved once, as the placement is: the context active at load wins
        self.device_time = devicetime.choose(
            devicetime.DeviceTime.from_meta(meta.get("device_time")),
            settings.get("device_time"))
        self.closed = False
        self._where: Tuple[int, int] = coreuse.current_request()
        self._loaded: Optional[_session.Loaded] = None
        self._lock = threading.Lock()

    # -- placement --------------------------------------------------------------

    @property
    def placement(self) -> Tuple[int, ...]:
        """Local indexes (``nc:i``) of the cores this model runs on (loading it if it
        never was; a released model keeps its last placement)."""
        record = self._loaded
        return record.placement if record is not None else self._record().placement

    @property
    def cores(self) -> Tuple[int, ...]:
        """Global ids of the cores this model runs on."""
        record = self._record()
        return tuple(core for core, _ in record.targets)

    @property
    def replicas(self) -> int:
        """How many cores hold a copy (calls go round robin over them)."""
        return len(self._record().targets)

    def place(self, start_nc: int = -1, nc_count: int = -1) -> None:
        """Move or replicate onto new cores: unloaded from the old ones first."""
        s = _session.current()
        coreuse.validate(start_nc, nc_count, len(s.cores))
        with self._lock:
            self._check_open()
            s.release(self.handle, defer=False)
            self._where = (start_nc, nc_count)
            block = s.book.choose(start_nc, nc_count)
            self._loaded = s.load(self.handle, self.graph, block, self._timing())

    def load(self) -> None:
        """Load onto the cores of the placement now (as the SDK does at load time)."""
        self._record()

    def replace_graph(self, graph: bytes) -> None:
        """Run ``graph`` (same signature, new weights) from now on: loaded again on the
        cores the model holds, new copies first, then the old ones unloaded; calls
        already sent finish on the old copies."""
        with self._lock:
            self._check_open()
            self.graph = graph
            record = self._loaded
            if record is None or not record.live:
                return   # loaded with the new graph by its next call
            s = record.session
            block = s.book.take(record.placement)
            self._loaded = s.load(self.handle, graph, block, self._timing())

    def use_buckets(self, buckets: Sequence[int], where: str) -> None:
        """Run this model's one graph at each of ``buckets`` (padded to the smallest
        that holds a call): for a trace without buckets of its own whose graph takes
        any multiple of its traced batch (checked at trace time).  A trace with
        buckets accepts only its own list."""
        buckets = chunking.check_buckets(list(buckets), self.batch, where)
        if self.buckets:
            if buckets != self.buckets:
                raise BatchBucketsError(list(buckets), "differs from the buckets the trace "
                                        f"holds {list(self.buckets)}", where)
            return
        bad = [b for b in buckets if b % self.batch]
        if not self.meta.get("any_batch") or bad:
            raise BatchBucketsError(
                list(buckets), f"needs a graph per bucket: this trace's graph runs only "
                f"{'multiples of ' if self.meta.get('any_batch') else ''}its traced batch "
                f"of {self.batch} rows (trace it with neuronmp.trace(..., batch_buckets=...))",
                where)
        self.buckets = buckets

    def _record(self) -> _session.Loaded:
        record = self._loaded
        if record is not None and record.live:
            return record
        with self._lock:
            record = self._loaded
            if record is not None and record.live:
                return record
            self._check_open()
            s = _session.current()
            if record is not None and max(record.placement) < len(s.cores):
                block = s.book.take(record.placement)  # as placed under a runtime now gone
            else:
                block = s.book.choose(*self._where)
            self._loaded = s.load(self.handle, self.graph, block, self._timing())
            return self._loaded

    def _timing(self) -> Tuple[int, ...]:
        return self.device_time.wire() if self.device_time is not None else ()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"neuronmp model {self.handle} was released")

    def close(self) -> None:
        """Release the cores; copies are unloaded at the session's next load (GC-safe)."""
        if self.closed:
            return
        self.closed = True
        _handles.pop(self.handle, None)
        record = self._loaded
        if record is not None and record.live:
            record.session.release(self.handle)

    # -- execution --------------------------------------------------------------

    def submit(self, args: Sequence[torch.Tensor], replica: Optional[int] = None,
               dynamic: Optional[bool] = None, into: Optional[Destination] = None,
               rows: Optional[int] = None, future: bool = True) -> Union[Answer, Pending]:
        """Start one call; an Answer of the flat list of output tensors.

        ``replica`` pins the call to one of the model's cores (its index in the
        placement); else calls go round robin.  With dynamic batching a batch is
        cut into traced-size batches, padded, spread over the cores (one message
        per core) and joined again; ``dynamic`` overrides the model's setting for this
        call (the BatchingServer batches whatever the model's setting).
        ``into``: buffers for the outputs (a Destination, or a Joint that DataParallel
        sends every chunk with), written straight from the core's answer when the
        call is exactly the traced inputs (one message, answered as is) and the
        outputs match them; otherwise ignored and left untouched.
        ``rows``: the inputs' dim-0 size, when the caller has checked them already
        (``Signature.rows``): DataParallel checks a call's inputs once, not each
        chunk's (on many cores those checks delay the last chunk's start, and so the
        call: docs/performance.md, "Device-time cores").
        ``future=False``: a ``Pending`` instead of an Answer, for a caller that only
        waits for it in ``result()`` (a traced call, DataParallel's chunks): no
        Future is built or settled per call (see ``pool.answer.Pending``).
        """
        dynamic = (self.dynamic if dynamic is None else dynamic) or bool(self.buckets)
        if rows is not None and self.batch and (rows == self.batch or dynamic):
            rows = None if rows == self.batch else rows
        else:
            rows = self.signature.check(args, dynamic)
        record = self._loaded
        if record is None or not record.live:
            record = self._record()
        pool = record.session.pool
        targets = record.targets
        if replica is not None:
            targets = (targets[replica % len(targets)],)
        first = record.next
        record.next = first + 1
        if rows is None:
            core, mid = targets[first % len(targets)]
            if self.buckets:
                self._count_runs([self.batch])
            return pool.call(core, mid, (1, *args), into, future)
        if self.buckets:
            return self._submit_buckets(args, rows, pool, targets, first, future)
        padding, counts = chunking.plan(rows, self.batch, len(targets))
        args = chunking.pad(args, padding)
        parts, start, b = [], 0, self.batch
        for j, n in enumerate(counts):
            core, mid = targets[(first + j) % len(targets)]
            piece = args if len(counts) == 1 else [x.narrow(0, start * b, n * b) for x in args]
            parts.append(pool.call(core, mid, (n, *piece), None, future))
            start += n
        if len(parts) == 1 and not padding:
            return parts[0]
        if padding:
            return gather(parts, lambda outs: chunking.strip(chunking.join(outs), rows),
                          future)
        return gather(parts, chunking.join, future)

    def _submit_buckets(self, args: Sequence[torch.Tensor], rows: int, pool: Any,
                        targets: Sequence[Tuple[int, int]], first: int,
                        future: bool = True) -> Union[Answer, Pending]:
        """A call of a bucketed model: each piece of the plan padded to its bucket and
        sent as one message (the worker runs that bucket's graph); the padding of
        each piece stripped from its outputs."""
        pieces = chunking.bucket_pieces(rows, self.buckets, len(targets))
        self._count_runs([b for _, b in pieces])
        parts, start = [], 0
        for j, (n, bucket) in enumerate(pieces):
            core, mid = targets[(first + j) % len(targets)]
            piece = args if len(pieces) == 1 else [x.narrow(0, start, n) for x in args]
            parts.append(pool.call(core, mid, (1, *chunking.pad(piece, bucket - n)), None,
                                   future))
            start += n
        if len(parts) == 1 and pieces[0][0] == pieces[0][1]:
            return parts[0]
        counts = [n for n, _ in pieces]
        return gather(parts, lambda outs: chunking.join(
            [chunking.strip(o, n) for o, n in zip(outs, counts)]), future)

    def bucket_for(self, rows: int) -> int:
        """The smallest of a bucketed model's batch sizes that holds ``rows`` (at most
        the largest), counted as run: for a caller that sends the batch itself."""
        bucket = chunking.fit(rows, self.buckets)
        self._count_runs([bucket])
        return bucket

    def _count_runs(self, buckets: Sequence[int]) -> None:
        with self._runs_lock:
            self.bucket_runs.update(buckets)

    def count_runs_in(self, other: Model) -> None:
        """Count this model's pieces in ``other``'s ``bucket_runs`` from now on: a
        replica DataParallel makes counts into the model the user traced, whose
        counter (``model_of(trace).bucket_runs``) is the one documented."""
        with self._runs_lock:
            other.bucket_runs.update(self.bucket_runs)
            self.bucket_runs = other.bucket_runs
            self._runs_lock = other._runs_lock

    def target(self, replica: int) -> Tuple[_session.Session, int, int]:
        """(session, global core, pool model id) of replica ``replica`` now, for a
        caller that sends to the core itself (a :class:`Route`)."""
        record = self._loaded
        if record is None or not record.live:
            record = self._record()
        core, mid = record.targets[replica % len(record.targets)]
        return record.session, core, mid

    def run(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Run one call to completion; the flat list of outputs."""
        return self.submit(args, future=False).result()

    def describe_signature(self) -> str:
        return self.signature.describe()

    def __repr__(self) -> str:
        record = self._loaded
        where = list(record.placement) if record is not None and record.live else "unloaded"
        return (f"<neuronmp Model {self.handle} inputs=({self.describe_signature()}) "
                f"placement={where} dynamic_batch={self.dynamic}"
                f"{f' batch_buckets={list(self.buckets)}' if self.buckets else ''}>")


class Route:
    """The one road from a formed batch to a model's core, for a batcher's thread
    or its event loop alike: ``send(args, count, replica, done)`` and, once,
    ``done(ok, value, on_loop)`` with the outputs (or the error).

        Route(model)        the pool's call; ``done`` runs in the thread that reads
                            the answer (the core's reader, or a loop owning the core)
        Route(model, loop)  the loop owns the core's rings (Session.loop_channel) and
                            ``done`` runs on it; a core another running loop owns
                            takes the pool's call, its answer handed to ``loop``

    A loop's route holds its channels: ``release`` (on the loop, nothing in flight)
    gives the cores back to the pool's reader; ``orphan`` (the loop closed, any
    thread) too, and ``on_orphan`` runs when the pool's supervisor saw the loop
    closed first.  ``timer(callback)`` is a timer of the loop, to the microsecond.
    """

    def __init__(self, model: Model, loop: Any = None,
                 on_orphan: Optional[Any] = None):
        self.model = model
        self.loop = loop
        self.thread = threading.get_ident() if loop is not None else 0
        self._channels: Dict[int, Any] = {}     # global core -> its channel (or None)
        self._on_orphan = on_orphan

    def send(self, args: Sequence[Any], count: int, replica: int, done: Any,
             into: Optional[Destination] = None) -> None:
        """Send ``args`` (``count`` whole traced batches, or one bucket) to replica
        ``replica``; ``into`` as for :meth:`Model.submit`.  Raises as the pool's
        call does (PoolClosedError, WorkerDiedError for a core given up)."""
        session, core, mid = self.model.target(replica)
        payload = (count, *args)
        if self.loop is None:
            answer = session.call(core, mid, payload, into)
            answer.add_done_callback(lambda a: _report(a, done))
            return
        answer = LoopAnswer(self.loop, self.thread, done, into)
        channel = self._channel(session, core)
        if channel is not None:
            channel.send(mid, payload, answer)
        else:   # another running loop owns the core: the pool's own path
            sent = session.call(core, mid, payload, into)
            sent.add_done_callback(lambda a: _forward(a, answer))

    def _channel(self, session: _session.Session, core: int) -> Any:
        held = self._channels.get(core)
        channel = session.loop_channel(core, self.loop, held)
        if channel is held and held is not None:
            return channel
        if held is not None:
            held.users -= 1
        if channel is not None:
            channel.users += 1
            channel.watchers.append(self._orphaned)
        self._channels[core] = channel
        return channel

    def timer(self, callback: Any) -> Timer:
        return Timer(self.loop, callback)

    def owns(self) -> List[Any]:
        """The channels this route sends through now."""
        return [c for c in self._channels.values() if c is not None]

    def release(self) -> None:
        """On the loop, nothing in flight: the cores no other user of the loop sends
        to go back to the pool's reader."""
        for channel in self.owns():
            channel.users -= 1
            if channel.users <= 0 and channel.idle:
                channel.detach()
        self._channels.clear()

    def orphan(self) -> None:
        """The loop is closed (any thread): its cores go back to the pool; what they
        still hold for it fails when read."""
        channels, self._channels = self.owns(), {}
        for channel in channels:
            channel.orphan()

    def _orphaned(self) -> None:
        if self._on_orphan is not None and self.loop.is_closed():
            self._on_orphan()


def _report(answer: Answer, done: Any) -> None:
    exc = answer.exception()
    done(exc is None, answer.result() if exc is None else exc, True)


def _forward(sent: Answer, answer: LoopAnswer) -> None:
    exc = sent.exception()
    if exc is None:
        answer.set_result(sent.result())
    else:
        answer.set_exception(exc)


def run_chunks(replicas: Sequence[Model], pieces: Sequence[Sequence[Any]],
               sizes: Sequence[int], *, whole: bool, dim: int = 0,
               in_place: bool = False) -> List[torch.Tensor]:
    """DataParallel's call: chunk ``k`` (``[p[k] for p in pieces]``, ``sizes[k]``
    rows) runs on ``replicas[k % n]``, every chunk in flight at once, the workers
    woken once all are sent; the chunks' outputs joined along ``dim``.

    ``whole``: the inputs were checked whole (``Signature.rows``), so no chunk is
    checked again.  ``in_place`` (dim 0): each chunk's outputs are written into
    its rows of the joined outputs where they are read, and the caller reads the
    other cores' answers while it waits for the first (worth it on device-time
    cores only, where an answer is read before it is due).  Every chunk has
    finished when this returns or raises (the first error, in chunk order)."""
    joint = Joint(sizes) if in_place and dim == 0 else None
    n = len(replicas)
    answers = whole and joint is not None and _send_together(replicas, pieces, sizes, joint)
    if not answers:
        with wakes_deferred():
            answers = [replicas[k % n].submit([p[k] for p in pieces],
                                              rows=size if whole else None, into=joint,
                                              future=False)
                       for k, size in enumerate(sizes)]
            if joint is not None:   # before the workers are woken to answer
                joint.expect(answers)
    try:
        with answers_read_ahead():
            results = _results(answers)
    finally:
        if joint is not None:   # no late answer writes into outputs the caller holds
            joint.close()
    return chunking.join(results, dim) if joint is None else joint.join(results)


def _send_together(replicas: Sequence[Model], pieces: Sequence[Sequence[Any]],
                   sizes: Sequence[int], joint: Joint) -> Optional[List[Pending]]:
    """A whole call's chunks, one traced batch per replica and core, sent together
    (``Pool.call_each``: one C call): one by one, the last chunk's modelled time waited
    behind every other chunk's Python (docs/performance.md, "Device-time cores").
    None for a call of another shape (then each chunk goes through ``submit``)."""
    batch = replicas[0].batch
    if len(sizes) > len(replicas) or not batch or sizes.count(batch) != len(sizes):
        return None
    session = None
    cores, mids, records = [], [], []
    for m in replicas[:len(sizes)]:   # a loop: the call's Python is what this saves
        record = m._loaded
        if record is None or not record.live or m.buckets or len(record.targets) != 1 or \
                (session is not None and record.session is not session):
            return None
        session = record.session
        cores.append(record.targets[0][0])
        mids.append(record.targets[0][1])
        records.append(record)
    if len(set(cores)) != len(cores):
        return None
    for record in records:
        record.next += 1    # as submit counts its calls
    return session.pool.call_each(cores, mids, [(1, *c) for c in zip(*pieces)], joint)


def _results(answers: Sequence[Pending]) -> List[List[torch.Tensor]]:
    """Every answer's outputs; the first error (in chunk order) is raised only once all
    have finished, so no chunk is still running when the call returns."""
    try:
        return [a.result() for a in answers]
    except BaseException:
        for a in answers:
            a.wait_done()
        raise


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- the handle table -------------------------------------------------------------


def new_model(graph: Union[bytes, memoryview], meta: Dict[str, Any], dynamic: bool = False,
              where: Optional[Tuple[int, int]] = None) -> Model:
    """Register a model placed at ``where`` = (start_nc, nc_count), else by the active
    context or the least-used default, and load it (as the SDK loads at trace time)."""
    model = Model(graph, meta, dynamic)
    if where is not None:
        model._where = where
    _handles[model.handle] = model
    if meta.get("lazy_load"):
        return model    # loaded by its first call (torch_neuronx.lazy_load)
    if meta.get("async_load"):
        # the first call waits for it on the model's lock (torch_neuronx.async_load);
        # a failed load is tried again, and raised, by that call
        threading.Thread(target=_load_quietly, args=(model,), daemon=True,
                         name=f"neuronmp-load-{model.handle}").start()
        return model
    try:
        model.load()
    except BaseException:
        model.close()
        raise
    return model


def _load_quietly(model: Model) -> None:
    try:
        model.load()
    except Exception:  # noqa: BLE001 - the model's first call loads again and raises
        pass


def attach(graph: torch.Tensor, meta: str, dynamic: bool) -> int:
    """Register the graph held by a wrapper; the model lives as long as that tensor.

    The model reads the graph's bytes where the wrapper keeps them, through a tensor
    of its own on the same storage (not a view: ``graph`` must stay free to die), so
    a large graph is neither copied nor held twice."""
    own = torch.empty(0, dtype=torch.uint8).set_(
        graph.untyped_storage(), graph.storage_offset(), graph.shape)
    model = new_model(memoryview(own.numpy()), json.loads(meta), dynamic)
    weakref.finalize(graph, model.close)
    return model.handle


def get(handle: int) -> Model:
    """The model behind a wrapper's handle."""
    try:
        return _handles[handle]
    except KeyError:
        raise RuntimeError(
            f"neuronmp model handle {handle} is not registered in this process "
            "(load traced models with torch.jit.load after `import neuronmp`)"
        ) from None


def is_traced(module: Any) -> bool:
    """True for a neuronmp traced wrapper (a scripted module carrying a handle)."""
    return isinstance(module, torch.jit.ScriptModule) and hasattr(module, HANDLE_ATTR)


def wrappers_in(module: Any) -> List[torch.jit.ScriptModule]:
    """Every neuronmp traced wrapper inside ``module`` (itself included)."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [m for m in module.modules() if is_traced(m)]


def model_of(wrapper: torch.jit.ScriptModule) -> Model:
    """The :class:`Model` of one traced wrapper."""
    return get(getattr(wrapper, HANDLE_ATTR))


def models_in(module: Any) -> List[Model]:
    """The :class:`Model` of every traced wrapper inside ``module``."""
    return [model_of(w) for w in wrappers_in(module)]
