"""The answer types: what a Future user, an asyncio caller and a blocking call wait on.

An :class:`Answer` is handed to whoever may want a Future; a :class:`Pending` is
the cheaper record a caller that only waits in ``result()`` holds (its contract
is in its docstring).  Both wait the same way, described here for the Answer.

An :class:`Answer` is a ``concurrent.futures.Future`` (built by its own
``__init__``, its state changed only through its public methods), so every Future
user works with it unchanged -- ``result(timeout)``, ``add_done_callback``,
``cancel``, ``concurrent.futures.wait`` and ``as_completed``,
``asyncio.wrap_future``.  What it adds is how a caller waits: on one futex flag
(``shm._waits``) with the GIL released, and with a helper that may produce the
answer in the waiting thread, rather than on the Future's condition variable.

    answering thread                              waiting thread
    settle(value)       Future.set_result ───▶   result(): helper(timeout)  (may read
    wake([answers])     one futex wake ──────▶             the answer in itself)
    (or set_result / set_exception:                      then flag_wait(flag)
     settle + wake)                                      (GIL released while asleep)

The contract:
  * ``settle`` (value or exception) is ``Future.set_result``/``set_exception``:
    first one wins, the loser gets ``InvalidStateError``; done-callbacks run in
    the settling thread.  It does not wake a thread asleep in ``result``:
    :func:`wake` does, for many answers in one call; ``set_result`` and
    ``set_exception`` settle and wake.
  * ``cancel`` is ``Future.cancel`` (only a pending answer; the pool's answers are
    running from the start, so they cannot be cancelled) and wakes the waiter.
  * ``result``/``exception``/``wait_done`` first let the ``helper`` work towards
    the answer in the waiting thread (``helper.wait(answer, timeout)``), then
    sleep on the flag; ``helper.watch(answer)`` runs when a callback is added
    (someone else must then produce the answer promptly, as nobody may ever wait).

A ``helper`` is how the pool's caller reads its own answer off the response ring
and how a joined answer waits for its parts.

An answer may carry a :class:`Destination` (``into``): buffers its outputs are
copied into straight from the response ring where the answer is read (one copy,
no fresh tensors), when they match the outputs exactly.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any, Callable, Iterable, List, Optional, Sequence

from ..ipc import _frames
from ..shm import _waits

# torch is imported where a Joint needs it, not here: importing torch runs neuronmp's
# op registration, which imports the API layer and so this module, which must not be
# half-made then (the case when this module is the first to import torch)

__all__ = ["Answer", "Destination", "Joint", "Pending", "gather", "wake"]

_flag_wait, _flags_set = _waits.flag_wait, _waits.flags_set
_copy = _frames.copy
_gather_lock = threading.Lock()   # the count of a gather's parts still out


class Helper:
    """What produces an answer, for its waiters (see the module docstring)."""

    def wait(self, answer: Answer, timeout: Optional[float]) -> None:
        """Work towards ``answer`` in the waiting thread, for at most ``timeout`` s."""

    def watch(self, answer: Answer) -> None:
        """``answer`` has a callback: make sure it is produced without a waiter."""


class Destination:
    """Buffers an answer's outputs go into where it is read, and the guard on them.

    Used only for an answer that is exactly as many contiguous CPU tensors of the
    buffers' dtypes and shapes, in order (a lone tensor or a list or tuple of
    them); any other answer comes as fresh tensors and the buffers stay untouched.
    They are written at most once, whole, under the guard's lock.  ``close()``
    waits for a write under way and no write starts after it: the owner closes
    before it answers its own caller, failed or not, so an answer that arrives
    after the request failed (timed out while its core ran it) never writes into
    buffers the caller may already use for something else.

    ``copy(dst_address, src_address, nbytes)`` copies each output in (by default a
    plain memcpy).  Buffers that view a file mapping someone else may shrink take
    ``shm._guard.copy``, which returns False where a memcpy would die of SIGBUS:
    then the answer comes as fresh tensors, and the buffers may hold part of it.
    """

    __slots__ = ("tensors", "_lock", "_open", "_copy")

    def __init__(self, tensors: Sequence[Any],
                 copy: Optional[Callable[[int, int, int], Any]] = None):
        for t in tensors:
            if not t.is_cpu or not t.is_contiguous():
                raise ValueError("a Destination takes contiguous CPU tensors, got one on "
                                 f"{t.device} with strides {t.stride()}")
        self.tensors = list(tensors)
        self._lock = threading.Lock()
        self._open = True
        self._copy = copy or _copy

    def fill(self, value: Any, answer: Optional[Answer] = None) -> Any:
        """Copy ``value`` (``answer``'s outputs, viewing the ring) into the buffers;
        the answer made of the buffers, or None when it does not fit or the guard is
        closed (nothing written), or the copy failed (see the class docstring)."""
        one = not isinstance(value, (list, tuple))
        got = [value] if one else value
        with self._lock:
            if not self._open or not self._fits(got):
                return None
            self._open = False
            for dst, src in zip(self.tensors, got):
                if self._copy(dst.data_ptr(), src.data_ptr(), src.nbytes) is False:
                    return None
        if one:
            return self.tensors[0]
        return type(value)(self.tensors)

    def _fits(self, got: Sequence[Any]) -> bool:
        if len(got) != len(self.tensors):
            return False
        for dst, src in zip(self.tensors, got):
            if type(src) is not type(dst) or src.dtype != dst.dtype or \
                    src.shape != dst.shape or not src.is_contiguous():
                return False
        return True

    def close(self) -> None:
        """From now on nothing is written (waits for a write under way)."""
        with self._lock:
            self._open = False


class Joint:
    """The outputs of one call cut into row ranges (DataParallel's chunks), each part's
    outputs copied into its rows straight from the ring where its answer is read.

    One Joint is every part's Destination: the caller sends part ``k`` with it as
    ``into`` and then names the parts' answers in order (``expect``), so nothing
    per part is made before the last part is sent.  The outputs are allocated
    when the first part is read, shaped by it; a part's answer then holds this
    Joint instead of tensors.  Answers read before they are due (the pool reads
    the other cores' answers while a caller waits for its first) are so joined
    before the call's last part is due, where a concatenation after it lengthened
    every DataParallel call (docs/performance.md, "Device-time cores").  ``join`` gives the joined
    outputs, copying in any part that came as tensors (read before ``expect``,
    or not fitting); like a Destination's, the guard is closed first.
    """

    __slots__ = ("rows", "tensors", "_lock", "_open", "_parts", "_starts")

    def __init__(self, rows: Sequence[int]):
        self.rows = rows
        self.tensors: Optional[List[Any]] = None
        self._lock = threading.Lock()
        self._open = True
        self._parts: dict = {}
        self._starts: List[int] = []

    def expect(self, answers: Sequence[Answer]) -> None:
        """The parts' answers, in part order (sent with this Joint as ``into``)."""
        starts, parts = [0], {}
        for k, a in enumerate(answers):
            parts[a] = k
            starts.append(starts[-1] + self.rows[k])
        with self._lock:
            self._starts, self._parts = starts, parts

    def fill(self, value: Any, answer: Optional[Answer] = None) -> Optional[Joint]:
        """Copy a part's outputs (viewing the ring) into its rows; this Joint, or None
        when it is not a part of it, does not fit, or the guard is closed."""
        got = _outputs(value)
        with self._lock:
            k = self._parts.get(answer)
            if not self._open or not got or k is None or not self._takes(k, got):
                return None
            start = self._starts[k]
            for dst, src in zip(self.tensors, got):
                _copy(dst.data_ptr() + start * dst.stride(0) * dst.element_size(),
                      src.data_ptr(), src.nbytes)
        return self

    def _takes(self, k: int, got: Sequence[Any]) -> bool:
        """Whether part ``k``'s outputs go into its rows: contiguous CPU tensors of
        ``rows[k]`` rows (so not, say, one row per part of a model that reduces the
        batch), of the outputs' dtypes and shapes; the outputs are made at the first."""
        import torch

        for src in got:
            if type(src) is not torch.Tensor or not src.dim() or not src.is_cpu or \
                    src.shape[0] != self.rows[k] or not src.is_contiguous():
                return False
        if self.tensors is None:
            total = self._starts[-1]
            self.tensors = [torch.empty((total, *t.shape[1:]), dtype=t.dtype) for t in got]
            return True
        return len(got) == len(self.tensors) and all(
            src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:]
            for dst, src in zip(self.tensors, got))

    def close(self) -> None:
        """From now on nothing is written (waits for a write under way)."""
        with self._lock:
            self._open = False
            # the parts' answers hold this Joint as ``into``: no cycle left for the
            # garbage collector (one per call kept each call's outputs alive until then)
            self._parts = {}

    def join(self, parts: Sequence[Any]) -> List[Any]:
        """Closed, the joined outputs of the parts' results (each this Joint when it
        was written in place, else its outputs)."""
        self.close()
        came = [(k, _outputs(got)) for k, got in enumerate(parts) if got is not self]
        if self.tensors is not None and all(self._takes(k, got) for k, got in came):
            for k, got in came:
                for dst, src in zip(self.tensors, got):
                    dst.narrow(0, self._starts[k], self.rows[k]).copy_(src)
            return self.tensors
        import torch

        pieces = [[t.narrow(0, self._starts[k], self.rows[k]) for t in self.tensors]
                  if got is self else _outputs(got) for k, got in enumerate(parts)]
        return [torch.cat(group) for group in zip(*pieces)]


def _outputs(value: Any) -> Sequence[Any]:
    """A call's outputs as a sequence: a lone output is one."""
    return value if isinstance(value, (list, tuple)) else [value]


class Answer(Future):
    """A pending answer; ``result()`` blocks (GIL released) until it is set.

    ``helper``: what produces the answer (see the module docstring); ``running``:
    the work has started (the pool's answers: sent at once), so it cannot be
    cancelled."""

    # where the answer's outputs are to be written (see Destination); set before sending
    into: Optional[Destination] = None

    def __init__(self, helper: Optional[Helper] = None, running: bool = False):
        super().__init__()
        self._flag = bytearray(4)
        #: True once the Future is done (set after its state changed, never before):
        #: what the pool's waiting loops test, several times per call, where
        #: Future.done() would take the condition's lock each time
        self.settled = False
        # (value, error) as the Future holds them, stored with ``settled``: result()
        # answers from it without the condition's lock (None: cancelled)
        self._outcome: Optional[tuple] = None
        self.helper = helper
        # the work is under way from the start (the pool sends at once): cancel()
        # refuses and running() says so, as for a Future an executor has started,
        # without a lock round through set_running_or_notify_cancel per answer
        self._started = running

    def running(self) -> bool:
        return (self._started and not self.done()) or super().running()

    def cancel(self) -> bool:
        """Cancel if nobody has started on it yet (as Future.cancel); wakes its waiter."""
        if self._started:
            return False
        cancelled = super().cancel()
        if cancelled:
            self.settled = True
            _flags_set((self._flag,))
        return cancelled

    # -- setting ----------------------------------------------------------------------

    def settle(self, value: Any = None, exc: Optional[BaseException] = None) -> None:
        """Store the answer without waking a sleeping waiter (see :func:`wake`);
        done-callbacks run here, in the settling thread."""
        if exc is None:
            super().set_result(value)
        else:
            super().set_exception(exc)
        self._outcome = (value, exc)
        self.settled = True

    def set_result(self, result: Any) -> None:
        self.settle(result)
        _flags_set((self._flag,))

    def set_exception(self, exception: Optional[BaseException]) -> None:
        self.settle(None, exception)
        _flags_set((self._flag,))

    def done(self) -> bool:
        # without the lock once settled; until then (and while the done-callbacks run
        # in the settling thread) the Future's own answer
        return self.settled or super().done()

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        super().add_done_callback(fn)
        if self.helper is not None and not self.done():
            self.helper.watch(self)

    # -- waiting ----------------------------------------------------------------------

    def _wait_flag(self, timeout: float) -> bool:
        """Sleep on the flag only (no helper): what a helper does between its reads."""
        return _flag_wait(self._flag, timeout)

    def wait_done(self, timeout: Optional[float] = None) -> bool:
        """Wait until set (at most ``timeout`` seconds, None: forever); whether it is."""
        if self.settled or self.done():
            return True
        if self.helper is None:
            return _flag_wait(self._flag, -1.0 if timeout is None else max(0.0, timeout))
        if timeout is None:
            self.helper.wait(self, None)
            return self.done() or _flag_wait(self._flag, -1.0)
        deadline = time.monotonic() + timeout
        self.helper.wait(self, timeout)
        return self.done() or _flag_wait(self._flag, max(0.0, deadline - time.monotonic()))

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.settled and not self.wait_done(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        outcome = self._outcome
        if outcome is None:   # cancelled, or settled but its callbacks still run here
            return super().result(0)
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self.settled and not self.wait_done(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        return super().exception(0)

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled() else "finished" if self.done() else \
            "running" if self.running() else "pending"
        return f"<neuronmp Answer {state}>"


class Pending:
    """The answer of a blocking call: what a caller that waits for its own answer
    (a traced call, DataParallel's chunks, a server lane's batch) holds instead of
    a Future.

    Building and settling a ``Future`` costs a Condition and several lock rounds
    per request; a caller that only ever calls ``result()`` needs none of it
    (docs/performance.md, "Device-time cores").  The contract, the part of
    :class:`Answer`'s that such a caller uses:

      * one value or one exception, set once by the one thread that took the
        request out of its core's pending table (the core's reader, the caller
        reading for itself, or the supervisor failing a dead worker's requests);
        a second setting raises ``InvalidStateError``, as a Future's would;
      * one futex flag: ``set_result``/``set_exception`` settle and wake, ``settle``
        alone does not (see :func:`wake`);
      * ``result``/``exception``/``wait_done`` let the ``helper`` (the core's
        channel, or the parts of a joined call) produce the answer in the waiting
        thread, then sleep on the flag; a timeout is ``TimeoutError``, a worker's
        death is the exception the supervisor sets;
      * no callbacks and no cancellation: whoever needs either (``submit()``,
        ``concurrent.futures``, asyncio) is handed an :class:`Answer`.
    """

    __slots__ = ("helper", "into", "_flag", "_value", "_exc", "settled")

    def __init__(self, helper: Optional[Helper] = None):
        self.helper = helper
        self.into: Any = None
        self._flag = bytearray(4)
        self._value: Any = None
        self._exc: Optional[BaseException] = None
        self.settled = False

    def done(self) -> bool:
        return self.settled

    def cancelled(self) -> bool:
        """Never: a blocking call's answer cannot be cancelled."""
        return False

    def settle(self, value: Any = None, exc: Optional[BaseException] = None) -> None:
        """Store the answer without waking a sleeping waiter (see :func:`wake`)."""
        if self.settled:
            raise InvalidStateError("the answer is already set")
        self._value, self._exc, self.settled = value, exc, True

    def set_result(self, result: Any) -> None:
        self.settle(result)
        _flags_set((self._flag,))

    def set_exception(self, exception: BaseException) -> None:
        self.settle(None, exception)
        _flags_set((self._flag,))

    def _wait_flag(self, timeout: float) -> bool:
        return _flag_wait(self._flag, timeout)

    wait_done = Answer.wait_done

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.settled and not self.wait_done(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self.settled and not self.wait_done(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        return self._exc

    def __repr__(self) -> str:
        return f"<neuronmp Pending {'finished' if self.settled else 'running'}>"


def wake(answers: Iterable[Answer]) -> None:
    """Wake the waiters of settled answers: one call, the GIL released."""
    _flags_set([a._flag for a in answers])


def gather(parts: Sequence[Any], combine: Callable[[List[Any]], Any],
           future: bool = True) -> Any:
    """One answer for several: ``combine([part results])`` once all are in, or the first
    failed part's error (after every part has finished, so none is still running).

    ``future=False``: the parts are :class:`Pending` and so is the joined answer,
    joined in the thread that waits for it."""
    if len(parts) == 1 and combine is None:
        return parts[0]
    if not future:
        return Pending(_Join(parts, combine))
    joined = Answer(_Parts(parts))
    joined.set_running_or_notify_cancel()
    remaining = [len(parts)]

    def one_done(_part: Future) -> None:
        with _gather_lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _finish(joined, parts, combine)

    for part in parts:
        part.add_done_callback(one_done)
    return joined


class _Parts(Helper):
    """A joined answer's helper: wait for (and watch) each part in turn."""

    def __init__(self, parts: Sequence[Answer]):
        self.parts = parts

    def wait(self, answer: Answer, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for part in self.parts:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not part.wait_done(left):
                return

    def watch(self, answer: Answer) -> None:
        for part in self.parts:
            if part.helper is not None and not part.done():
                part.helper.watch(part)


class _Join(_Parts):
    """A joined Pending's helper: wait for each part, then join them in this thread."""

    def __init__(self, parts: Sequence[Pending], combine: Callable[[List[Any]], Any]):
        super().__init__(parts)
        self.combine = combine

    def wait(self, answer: Pending, timeout: Optional[float]) -> None:
        super().wait(answer, timeout)
        if not answer.done() and all(part.done() for part in self.parts):
            _finish(answer, self.parts, self.combine)


def _finish(joined: Any, parts: Sequence[Any], combine) -> None:
    try:
        for part in parts:
            if part.cancelled():
                raise CancelledError()
            exc = part.exception(0)
            if exc is not None:
                raise exc
        value = combine([p.result(0) for p in parts])
    except BaseException as exc:  # noqa: BLE001 - the joined caller must hear of it
        joined.set_exception(exc)
        return
    joined.set_result(value)
