"""Supervision: a worker's death noticed, what it had failed or sent again.

    supervisor thread (one per pool): waits on every worker's pidfd
       a worker died ─▶ replace(): answers it sent are delivered; the request it
                        ran fails (WorkerDiedError, ExecTimeoutError); the ones it
                        never read are sent again to a worker started on the same
                        core, after its models are loaded again
       no progress past NEURON_RT_EXEC_TIMEOUT ─▶ SIGKILL, then as above

A worker's death is noticed the moment the kernel reports it, and the restart
runs on the supervisor's thread, never on a caller's: a caller only ever waits
for its own answer.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import signal
import threading
import time

from ..errors import ExecTimeoutError, PeerDiedError, WorkerDiedError
from ..shm.segment import sweep
from . import limits
from . import protocol as P
from .workerproc import _exiting

log = logging.getLogger(__name__)

_now_ns = time.perf_counter_ns


def supervise(pool) -> None:
    """The supervisor thread of ``pool`` (a ``coordinator.Pool``): wait on every
    worker's death notice; replace the ones that die, and stop the
    ones that make no progress past NEURON_RT_EXEC_TIMEOUT (this thread only)."""
    # read once: the settings are fixed for the runtime the pool lives in
    exec_timeout = limits.exec_timeout()
    poll = None if not exec_timeout else min(1.0, exec_timeout / 4)
    while not pool._closed:
        watched = {w.death_handle(): w for w in pool._workers.values()
                   if w.proc is not None and not (w.stopping or w.done)}
        ready = multiprocessing.connection.wait([pool._wake_r, *watched], poll)
        for handle in ready:
            if handle == pool._wake_r:
                os.read(pool._wake_r, 64)
            elif not pool._closed:
                _replace(watched[handle])
        if poll is not None and not pool._closed:
            now = time.monotonic()
            for w in watched.values():
                w.check_progress(now, exec_timeout)
                owner = w.owner
                if owner is not None and owner.loop_closed():
                    owner.orphan()   # its loop is gone: the reader thread reads


def _replace(worker) -> None:
    try:
        worker.replace()
    except Exception as exc:  # noqa: BLE001 - the other cores must stay supervised
        log.error("could not restart the worker of NeuronCore %d: %r; requests to it fail",
                  worker.core, exc, exc_info=exc)


class Supervised:
    """The supervisor's side of a core's channel (``channel.CoreChannel``)."""

    def replace(self) -> None:
        """The process died: fail what it was running, re-send what it never read.

        Runs on the supervisor's thread.  Answers the dead worker had already sent
        are delivered; the one request it was executing (the stats block's
        ``running``) fails with WorkerDiedError (or ExecTimeoutError if the
        supervisor stopped it); every later request was never read, so it is sent
        again, in order, to the replacement, after the models are loaded again.
        Holding ``lock`` meanwhile queues new requests behind them.  No answer is
        settled on this thread while it holds a lock: a done-callback may send
        (retry a failed request), and would wait for the lock it holds.  Those
        settled before the restart are settled by a thread of their own, so their
        callers hear at once and their callbacks' sends queue like any other.
        """
        late: list = []   # (answer, ok, payload)
        try:
            self._replace(late)
        finally:
            for answer, ok, payload in late:
                self._settle(answer, ok, payload)
            owner = self.owner
            if owner is not None:   # its flag was raised on the dead worker's rings
                owner.kick()
        self.work.set()

    def _replace(self, late: list) -> None:
        self.dead = True   # a thread reading the ring leaves it (its pump checks)
        # rx_lock first: an answer's callbacks run in the thread that read it, with
        # rx_lock held, and may send (take lock)
        with self.rx_lock, self.lock:
            err = self._death()
            running = self.pool._stats.get(self.slot, "running")
            self.pool._stats.set(self.slot, "running", 0)
            late += self._drain()
            self._into.clear()  # re-sent requests are sent under new ids
            self.req.close()
            self.resp.close()
            sweep()  # what the dead worker wrote and nobody will read (its spill arena)
            sent, self.pending = self.pending, {}
            again = self._triage(sent, running, err, late)
            if self.stopping or _exiting():
                self.done = True
                late += [(e[0], False, err) for e in again]
                return
            # settled now, not after the restart (which may take seconds)
            _settle_apart(self, late[:])
            late.clear()
            self.pool._stats.add(self.slot, "restarts")
            try:
                self._restart()
            except BaseException:
                late += [(e[0], False, err) for e in again]
                self._abandon()
                raise
            self.dead = False
            loading = {e[2] for e in again if e[1] == P.LOAD}
            for mid, spec in list(self.models.items()):
                if mid not in loading:
                    self._send_locked(P.LOAD, mid, spec.payload())
            for answer, op, mid, payload, tries in again:
                self._send_locked(op, mid, payload, answer, tries + 1)

    def _restart(self) -> None:
        """Start the replacement; one killed while it starts (a chaos test, an OOM kill)
        is replaced again rather than leaving the core down for good."""
        for attempt in range(limits.START_TRIES):
            try:
                self._start_process()
                self.wait_ready(time.monotonic() + limits.ready_timeout())
                return
            except WorkerDiedError:
                if attempt + 1 == limits.START_TRIES:
                    raise
                for ring in (self.req, self.resp):
                    ring.close()
                sweep()

    def _drain(self) -> list:
        """The answers a dead worker sent before it died (rx_lock held), to settle now
        as ``(answer, ok, payload)``; those not due yet are settled when they are due,
        by a timer: the supervisor does not wait for them."""
        answers = [self._early] if self._early is not None else []
        self._early = None
        while True:
            try:
                rid, ok, payload, due = self.resp.recv(timeout=0)
            except (queue.Empty, PeerDiedError):
                break
            answers.append((due, rid, ok, payload))
        now = []
        for due, rid, ok, payload in answers:
            entry = self.pending.pop(rid, None) if rid != P.BYE_ID else None
            wait = (due - _now_ns()) / 1e9
            if entry is None:
                continue
            if wait <= 0:
                now.append((entry[0], ok, payload))
            else:
                timer = threading.Timer(wait, self._settle, (entry[0], ok, payload))
                timer.daemon = True
                timer.start()
        return now

    def _triage(self, sent: dict, running: int, err: BaseException, late: list) -> list:
        """Of a dead worker's requests: fail the one it ran (and any re-sent once
        already that died unstarted: a request that kills its worker must not loop),
        added to ``late``; return the others, in send order, to send again."""
        again = []
        for rid, entry in sent.items():
            answer, op, mid, _payload, tries = entry
            if rid == running or (tries and not running):
                timed_out = rid == self._timed_out
                if op == P.RUN:   # an execution's outcome, for monitors (the supervisor's field)
                    self.pool._stats.add(self.slot, "timed_out" if timed_out else "died")
                late.append((answer, False, ExecTimeoutError(self.core, mid, limits.exec_timeout())
                             if timed_out else err))
            else:
                again.append(entry)
        self._timed_out = 0
        return again

    @staticmethod
    def _fail(entries, err: BaseException) -> None:
        for entry in entries:
            try:
                entry[0].set_exception(err)
            except Exception:  # already settled (cancelled): nothing to tell
                pass

    def check_progress(self, now: float, limit: float) -> None:
        """Stop the worker if it holds requests and finished none for ``limit`` seconds
        (a model stuck in a loop, a SIGSTOPped process); ``replace`` then fails the
        request it was running with ExecTimeoutError and re-sends the rest."""
        if not self.pending or self.dead:
            self._progress = (-1, now)
            return
        done = self.pool._stats.get(self.slot, "done")
        if done != self._progress[0]:
            self._progress = (done, now)
        elif now - self._progress[1] > limit:
            self._timed_out = self.pool._stats.get(self.slot, "running") or \
                next(iter(self.pending), 0)
            self._progress = (-1, now)
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _abandon(self) -> None:
        """A replacement failed to start: the core stays down, its segments go now."""
        self.done = True
        self._close_pidfd()
        if self.proc is not None and self.proc.pid is not None:
            self.proc.kill()
            self.proc.join(2.0)
        for ring in (self.req, self.resp):
            if ring is not None:
                ring.close()

    def _fail_pending(self, err: BaseException) -> None:
        failed, self.pending = self.pending, {}
        self._into.clear()
        self._fail(failed.values(), err)



def _settle_apart(worker: Supervised, settled: list) -> None:
    """Settle ``(answer, ok, payload)`` items on a short-lived thread of their own."""
    if not settled:
        return

    def run() -> None:
        for answer, ok, payload in settled:
            worker._settle(answer, ok, payload)

    threading.Thread(target=run, daemon=True, name=f"neuronmp-settle-nc{worker.core}").start()


