"""The process serving one NeuronCore: runs the models loaded on it.

Started by the coordinator from a forkserver that has already imported this
module, and so torch: a worker costs a fork, not a cold ``import torch``.

    coordinator ──request ring──▶ recv_view ─▶ model(*args) ─▶ send ──response ring──▶

The worker pins itself to its core's CPUs and matches torch's thread count to
them, keeps the memory its model frees for the next request (see
``_keep_freed_memory``), names itself ``neuronmp-nc<core>`` (``ps -o comm``),
ignores SIGINT (a Ctrl-C at the terminal is the coordinator's to handle) and
exits on its own when the coordinator dies: every ring wait re-checks the
coordinator's identity.
"""
from __future__ import annotations

import ctypes
import io
import os
import signal
import time
import traceback
from typing import Dict, Sequence

import psutil
import torch

from .. import _torchscript, liveness
from ..devicetime import wire_cost_ns
from ..errors import PeerDiedError, WeightWriteError
from ..ipc import Ring
from . import protocol as P
from .stats import StatsBlock
from .weights import MappedWeights

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound on 64-bit hosts


def worker_main(core: int, cpus: Sequence[int], runtime_dir: str, req_name: str,
                resp_name: str, coordinator: tuple, stats_name: str, slot: int,
                hold: float = 0.0, keep_mb: int = 0) -> None:
    """Entry point of a worker process (runs in the forked child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the forkserver's import of neuronmp installed the runtime's handler: a worker
    # has no runtime, and a SIGTERM must end it at once, even inside a model
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _name_and_tie(core)
    _keep_freed_memory(keep_mb)
    # The forkserver was started with the environment of an earlier moment:
    # take the runtime directory from the coordinator, not from our environment.
    os.environ["NEURONMP_RUNTIME_DIR"] = runtime_dir
    psutil.Process().cpu_affinity(list(cpus))
    torch.set_num_threads(len(cpus))
    req = Ring.attach(req_name, populate=False)  # see _CoreWorker._start_process
    resp = Ring.attach(resp_name, populate=False)
    req.set_peer(coordinator)
    resp.set_peer(coordinator)
    stats = StatsBlock.attach(stats_name)
    try:
        resp.send((P.READY_ID, True, os.getpid()))
        with torch.inference_mode():
            _serve(core, req, resp, stats, slot, hold)
    except PeerDiedError:
        pass  # the coordinator is gone: nobody is left to answer
    finally:
        stats.close()
        req.close()
        resp.close()
        liveness.release()  # our spill arenas are closed: our .live file goes too


def _name_and_tie(core: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, f"neuronmp-nc{core}".encode(), 0, 0, 0)
        # our parent is the forkserver, which lives while any coordinator does;
        # if it is killed outright, go with it rather than linger unowned
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # the kernel's default 50 us of slack on every sleep would lengthen each
        # modelled device call (see _DeviceClock)
        libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _keep_freed_memory(keep_mb: int) -> None:
    """Serve activations from the heap instead of fresh pages on every request.

    torch's CPU allocator is glibc malloc.  Past glibc's default thresholds each
    activation of a few MiB is mmap'ed and unmapped, or the heap top is trimmed
    after every request, so every request faults its activations in again: a
    conv net at batch 32 took 1500 page faults and twice the time per call.  A
    worker runs one model in a loop, so it keeps what it freed, up to
    ``keep_mb`` (0: glibc's defaults), as torch's caching allocators do on GPUs.
    """
    if keep_mb <= 0:
        return
    keep = min(keep_mb, 2047) << 20  # mallopt takes a C int
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, min(keep, _MMAP_THRESHOLD_MAX))
        libc.mallopt(_M_TRIM_THRESHOLD, keep)
    except (OSError, AttributeError):  # not glibc: its allocator, its policy
        pass


def _serve(core: int, req: Ring, resp: Ring, stats: StatsBlock, slot: int,
           hold: float) -> None:
    models: Dict[int, torch.jit.ScriptModule] = {}
    timings: Dict[int, tuple] = {}  # model id -> its latency model (DeviceTime.wire())
    shared: Dict[int, MappedWeights] = {}  # model id -> its mapping of shared weights
    clock = _DeviceClock(spin=hold > 0)  # hold is 0 on CPUs shared with other cores
    others = -1
    while True:
        if hold:
            # A caller in a loop sends its next request within tens of us: stay
            # awake for it instead of paying a futex wake-up -- but only while
            # this is the only core in use: a spinning neighbour slows the
            # others' work (hyperthread siblings, the coordinator's CPU time).
            now = stats.others_submitted(slot)
            req.hold = hold if now == others else 0.0
            others = now
        frame = req.recv_view()
        try:
            op, rid, mid, payload = frame.value
            if op == P.STOP:
                resp.send((P.BYE_ID, True, None))
                return
            t0 = time.perf_counter_ns()
            stats.set(slot, "running", rid)  # from here a death may have run it: not re-sent
            try:
                result = _handle(core, op, mid, payload, models, timings, shared)
                if op == P.RUN and mid in timings:
                    clock.wait(t0, timings[mid], payload, req)
                else:
                    clock.queued = False
                if op == P.INFO:
                    result = _info(core, models)
                answer = (rid, True, result)
            except WeightWriteError as exc:  # crosses as itself: the caller catches its class
                stats.add(slot, "errors")
                answer = (rid, False, exc)
            except Exception as exc:
                stats.add(slot, "errors")
                answer = (rid, False, (type(exc).__name__, str(exc), traceback.format_exc()))
            # counted before the answer leaves, so a caller holding its result
            # never sees its own request still in flight
            stats.finished(slot, time.perf_counter_ns() - t0)
            try:
                resp.send(answer)
            except (TypeError, ValueError, OSError) as exc:
                # an output the transport cannot carry, or no shared memory to carry it
                # in (ShmSpaceError): that request fails, the worker lives on
                resp.send((rid, False, (type(exc).__name__, f"cannot return the model's "
                                        f"output: {exc}", traceback.format_exc())))
            stats.set(slot, "running", 0)
        finally:
            frame.release()


def _info(core: int, models) -> dict:
    return {
        "core": core,
        "pid": os.getpid(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "models": sorted(models),
    }


class _DeviceClock:
    """Waits out a request's modelled device time without burning the CPU.

    A sleep on a VM overshoots by 50-150 us (more under load), which would make
    every modelled call that much longer.  Two things keep the modelled time exact:

    - the clock sleeps until ``overshoot`` before the deadline, learns the
      overshoot it got (a moving average), and spins only through what is left;
    - a request that was already queued before the previous one's deadline starts,
      as on the device, at that deadline, not when the late-waking worker picks it
      up: under load the lateness does not add up, so throughput is cores / cost.

    A request is never answered sooner than its modelled time after it was sent.

    Without a CPU of its own (``spin=False``: 32 cores emulated on 2 CPUs) the clock
    only sleeps: spinning through the margin there took a CPU the other cores'
    workers needed (32 workers on 2 CPUs spent 150-220 us of CPU per 2 ms request,
    most of it spinning), so such a core answers late by a wake-up, and the second
    point above keeps queued requests on time.
    """

    def __init__(self, spin: bool = True):
        self.spin = spin
        self.overshoot = 80_000 if spin else 0  # ns
        self.free_at = 0  # the previous request's deadline
        self.queued = False  # the next request was waiting before that deadline

    def wait(self, t0: int, timing: tuple, payload, req: Ring) -> None:
        start = self.free_at if self.queued else t0
        deadline = start + wire_cost_ns(timing, _rows(payload))
        now = time.perf_counter_ns()
        # a frame already in the ring now was sent before this deadline
        self.queued = now < deadline and req.pending()
        self.free_at = deadline
        wake = deadline - self.overshoot
        if wake > now:
            time.sleep((wake - now) / 1e9)
            if self.spin:
                late = time.perf_counter_ns() - wake
                self.overshoot = min(max((self.overshoot * 7 + late) // 8, 5_000), 500_000)
        while time.perf_counter_ns() < deadline:
            pass


def _rows(payload) -> int:
    """Dim 0 of a RUN request's first input (its payload is ``(n, *inputs)``)."""
    first = payload[1] if len(payload) > 1 else None
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1


def _handle(core: int, op: int, mid: int, payload,
            models: Dict[int, torch.jit.ScriptModule], timings: Dict[int, tuple],
            shared: Dict[int, MappedWeights]):
    if op == P.RUN:
        try:
            model = models[mid]
        except KeyError:
            raise KeyError(f"model {mid} is not loaded on this core") from None
        weights = shared.get(mid)
        try:
            return model.forward(*payload)  # a ScriptMethod: no nn.Module call machinery
        finally:
            if weights is not None:
                weights.check()  # one integer compared; a write fails the call, the core lives
    if op == P.LOAD:
        _drop(mid, models, timings, shared)
        models[mid], timing, weights = load_model(core, mid, payload)
        if timing:
            timings[mid] = timing
        if weights is not None:
            shared[mid] = weights
        return None
    if op == P.UNLOAD:
        _drop(mid, models, timings, shared)
        return None
    if op == P.INFO:
        return None
    raise ValueError(f"unknown request op {op!r}")


def load_model(core: int, mid: int, payload: tuple):
    """A LOAD's payload ``(graph, timing, weights)`` made into ``(module, timing,
    MappedWeights or None)``: the graph (``torch.jit.save`` bytes as a uint8 tensor)
    loaded, and when ``weights`` (``SharedWeights.wire()``) is given, its emptied
    parameters and buffers pointed at the shared copy."""
    graph, timing, weights = payload
    with _torchscript.quiet():
        module = torch.jit.load(io.BytesIO(graph.numpy().tobytes()), map_location="cpu")
    module.eval()
    mapped = None
    if weights is not None:
        name, manifest = weights
        mapped = MappedWeights(module, name, manifest, core, mid)
    return module, tuple(timing), mapped


def _drop(mid: int, models, timings, shared) -> None:
    models.pop(mid, None)
    timings.pop(mid, None)
    weights = shared.pop(mid, None)
    if weights is not None:
        weights.close()


def _warm_torchscript() -> None:
    """Pay TorchScript's first-load costs (5-6 ms of CPU: its type and operator
    tables) once, at import, in the forkserver that every worker is forked from:
    otherwise each of 32 workers pays them in its first LOAD, 0.1 s of 2 CPUs.
    A scripted Identity: nothing runs, so no thread pool is started before a fork."""
    try:
        buf = io.BytesIO()
        with _torchscript.quiet():
            torch.jit.save(torch.jit.script(torch.nn.Identity()), buf)
            buf.seek(0)
            torch.jit.load(buf, map_location="cpu")
    except Exception:  # noqa: BLE001 - only a warm-up: the first LOAD pays instead
        pass


_warm_torchscript()
