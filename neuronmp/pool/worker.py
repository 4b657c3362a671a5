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
import queue
import signal
import time
import traceback
from collections import deque
from typing import Dict, Sequence, Tuple

import psutil
import torch

from ..errors import PeerDiedError, WeightWriteError
from ..host import _torchscript, liveness
from ..host.devicetime import wire_cost_ns
from ..ipc.ring import Ring
from . import protocol as P
from .stats import Recorder, StatsBlock
from .weights import MappedWeights, load_graph

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_FROM_FILE = 1 << 20  # graphs this big load from a scratch file (see weights.load_graph)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound on 64-bit hosts
# a timed request counts as done this long before its answer is due: the count must
# not trail the caller, who gets the answer at the due time, even when this worker
# wakes late on a loaded host (a margin of a fraction of a millisecond was not enough:
# docs/performance.md, "Figures behind the code's choices"); and a request modelled
# at no more than this is counted at once, without a wake-up of its own
_COUNT_EARLY = 2_000_000  # ns


def worker_main(core: int, cpus: Sequence[int], runtime_dir: str, req_name: str,
                resp_name: str, coordinator: tuple, stats_name: str, slot: int,
                spin_budget: float = 0.0, keep_mb: int = 0, package: str = "",
                ready=None) -> None:
    """Entry point of a worker process (runs in the forked child); ``package``: the
    directory of the coordinator's neuronmp, which must be this process's too;
    ``ready``: the core's readiness fd (passed over the forkserver's socket), written
    when an event loop that reads the rings sleeps on it."""
    ready_fd = ready.detach() if ready is not None else -1
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
        if package and package != P.PACKAGE_DIR:   # refused in READY: see WorkerPackageError
            resp.send((P.READY_ID, False, P.PACKAGE_DIR, 0))
            return
        resp.send((P.READY_ID, True, os.getpid(), 0))
        with torch.inference_mode():
            _serve(core, req, resp, stats, slot, spin_budget, ready_fd)
    except PeerDiedError:
        pass  # the coordinator is gone: nobody is left to answer
    finally:
        if ready_fd >= 0:
            os.close(ready_fd)
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
           spin_budget: float, ready_fd: int = -1) -> None:
    models: Dict[int, torch.jit.ScriptModule] = {}
    timings: Dict[int, tuple] = {}  # model id -> its latency model (DeviceTime.wire())
    shared: Dict[int, MappedWeights] = {}  # model id -> its mapping of shared weights
    held: Dict[int, Tuple[int, int]] = {}  # model id -> (weight bytes, graph bytes without)
    sized: set = set()  # models whose tensors' bytes were counted since their LOAD
    rec = stats.recorder(slot)
    free_at = 0  # when the modelled device finishes the last timed request (ns)
    owed: deque = deque()  # (count at, busy ns) of timed requests answered, not yet done
    timed = False  # the last request was a timed one
    others = -1
    while True:
        if spin_budget:
            # A caller in a loop sends its next request within tens of us: stay
            # awake for it instead of paying a futex wake-up -- but only while
            # this is the only core in use: a spinning neighbour slows the
            # others' work (hyperthread siblings, the coordinator's CPU time).
            # After a timed request the next one comes a modelled time later,
            # and its start is its send time anyway: a late wake-up costs nothing.
            now = stats.others_submitted(slot)
            req.spin_budget = spin_budget if now == others and not timed else 0.0
            others = now
        if req.pending():
            frame = _next_request(req, owed, rec)
        else:
            t0 = time.perf_counter_ns()
            frame = _next_request(req, owed, rec)
            req.spin = _next_spin(req, time.perf_counter_ns() - t0)
        try:
            op, rid, mid, payload, sent = frame.value
            if op == P.STOP:
                while owed:
                    rec.finished(owed.popleft()[1])
                resp.send((P.BYE_ID, True, None, 0))
                return
            t0 = time.perf_counter_ns()
            stats.set(slot, "running", rid)  # from here a death may have run it: not re-sent
            due, timed, ran = 0, False, False
            try:
                result = _handle(core, op, mid, payload, models, timings, shared)
                if op == P.RUN:
                    ran = True
                    if mid in timings:
                        timed = True
                        due, busy = _modelled(sent, free_at, timings[mid], payload)
                        free_at = due
                elif op == P.INFO:
                    result = _info(core, models, req)
                else:   # LOAD, UNLOAD: what the core's models hold now
                    _held(mid, op, payload, models, shared, held, rec)
                    sized.discard(mid)
                    if op == P.LOAD and not spin_budget:
                        _yield_to_callers(bool(timings))
                answer = (rid, True, result, due)
            except WeightWriteError as exc:  # crosses as itself: the caller catches its class
                stats.add(slot, "errors")
                rec.failed("model_errors")
                answer = (rid, False, exc, 0)
            except Exception as exc:
                stats.add(slot, "errors")
                if op == P.RUN:
                    rec.failed("model_errors")
                answer = (rid, False, (type(exc).__name__, str(exc), traceback.format_exc()), 0)
            # counted before the answer leaves, so a caller holding its result
            # never sees its own request still in flight; a timed one is in
            # flight until its modelled time is (almost) over
            if due:
                owed.append((due - _COUNT_EARLY, busy))
            else:
                now = time.perf_counter_ns()
                busy = now - t0
                rec.finished(busy)
            try:
                resp.send(answer)
            except (TypeError, ValueError, OSError) as exc:
                # an output the transport cannot carry, or no shared memory to carry it
                # in (ShmSpaceError): that request fails, the worker lives on
                if ran:
                    ran = False
                    rec.failed("runtime_errors")
                resp.send((rid, False, (type(exc).__name__, f"cannot return the model's "
                                        f"output: {exc}", traceback.format_exc()), 0))
            if ran:   # after the answer left: what monitors read costs the caller nothing
                n = rec.ran(busy, (due or now) - sent)   # a timed one's device time: modelled
                if mid not in sized or not n & 63:
                    # the tensors' bytes: at a model's first execution, then one in 64
                    # (their shapes seldom change; adding them up costs the most here)
                    sized.add(mid)
                    rec.tensors(_io_bytes(payload, result))
            stats.set(slot, "running", 0)
        finally:
            frame.release()
        # an event loop reading our answers (or waiting for room to send) sleeps on
        # the fd only when it said so: a loop that is busy costs no system call
        if ready_fd >= 0 and (resp.take_fd_request() | req.take_fd_request()):
            _notify(ready_fd)


def _next_spin(req: Ring, waited_ns: int) -> bool:
    """Whether the wait for the next request spins, after one of ``waited_ns``.

    Judged against the window the wait spins for when spinning is on, also when it
    was off: a wait without a spin includes the futex wake-up, so against the
    probe alone a caller whose requests come a little apart (a compiled call's
    Dynamo guards and copies between its requests) never got spinning back once a
    pause had turned it off, and paid a wake-up on every request."""
    return _keep_spinning(waited_ns, req.spin_window_on)


def _keep_spinning(waited_ns: int, window: float) -> bool:
    """Whether the next wait for a request may spin, after one that waited
    ``waited_ns`` with a spin window of ``window`` seconds.

    A request that came within the window (or soon after it: a sleeper's wake-up
    costs tens of microseconds on a VM) says the caller sends in a loop, and the
    spin saves a futex wake-up per request.  One that came later says the spin was
    lost: under a server's load a core's batches come milliseconds apart, and on a
    small host every spin is CPU the HTTP process and its clients needed.  A wait
    that did not spin (``window`` 0.0) and was short turns spinning back on."""
    return waited_ns <= 2 * max(window, _SPIN_PROBE) * 1e9


# a wait without a spin shorter than this says a spin would have caught the request
_SPIN_PROBE = 50e-6


def _notify(fd: int) -> None:
    try:
        os.write(fd, _ONE)
    except BlockingIOError:   # the counter is full: the loop is awake
        pass


_ONE = (1).to_bytes(8, "little")


def _yield_to_callers(timed: bool) -> None:
    """On CPUs shared with other cores, a worker serving a device-time model runs as
    a batch task: woken by a request, it does not preempt the thread that is still
    sending the rest of the call (nor a neighbour computing), since its wake-up and
    computing overlap the modelled time anyway.  Other models keep the default
    policy: their answer's latency is the worker's."""
    policy = os.SCHED_BATCH if timed else os.SCHED_OTHER
    try:
        if os.sched_getscheduler(0) != policy:
            os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass


def _next_request(req: Ring, owed: deque, rec: Recorder):
    """The next request's frame; meanwhile each timed request answered early is
    counted done as its modelled time ends, so the core's in-flight count (the
    server's queue depth, neuronmp-top) covers the modelled time.  That costs a
    wake-up only when no request came in the meantime."""
    while owed:
        left = owed[0][0] - time.perf_counter_ns()
        if left <= 0:
            rec.finished(owed.popleft()[1])
            continue
        try:
            return req.recv_view(timeout=left / 1e9)
        except queue.Empty:
            pass
    return req.recv_view()


def _io_bytes(payload, result) -> int:
    """Bytes of an execution's input and output tensors (a tuple or list of them
    counted one level deep; anything else, such as a Model's leading row count,
    counts nothing)."""
    total = 0
    for item in payload:
        if isinstance(item, torch.Tensor):
            total += item.nbytes
    if isinstance(result, torch.Tensor):
        total += result.nbytes
    elif isinstance(result, (tuple, list)):
        for item in result:
            if isinstance(item, torch.Tensor):
                total += item.nbytes
    return total


def _held(mid: int, op: int, payload, models, shared, held, rec) -> None:
    """After a LOAD or UNLOAD: the weight and graph bytes of the core's models, to the
    stats block.  A model's weights are its parameters' and buffers' bytes; its graph
    is the archive it came in without them (a skeleton when its weights are shared)."""
    held.pop(mid, None)
    if op == P.LOAD and mid in models:
        weights = sum(t.nbytes for t in models[mid].state_dict().values()
                      if isinstance(t, torch.Tensor))
        archive = payload[0].numel()
        held[mid] = (weights, archive if mid in shared else max(0, archive - weights))
    rec.memory(sum(w for w, _ in held.values()), sum(c for _, c in held.values()))


def _info(core: int, models, req: Ring) -> dict:
    return {
        "core": core,
        "pid": os.getpid(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "models": sorted(models),
        # whether the wait for the next request spins (see _keep_spinning)
        "spins": req.spin,
    }


def _modelled(sent: int, free_at: int, timing: tuple, payload) -> Tuple[int, int]:
    """(due, busy): when a timed request's answer may be taken, and its modelled time.

    The modelled device starts a request when it was sent, or, if it was still
    running the previous one then, when that one ended: the worker's own wake-up
    and computing (done by now) overlap the modelled time, as a real core's queue
    does not wait for a host process to notice it, and lateness does not add up.
    The worker answers at once with the due time; the coordinator keeps the answer
    from its caller until then (``channel.CoreChannel._read_until``).  So a core never answers
    sooner than its modelled time after the request was sent, and the worker spends
    no wake-up on the device time: it sleeps only for the next request.
    """
    start = max(sent, free_at)
    cost = wire_cost_ns(timing, _rows(payload))
    return start + cost, cost


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
    if graph.numel() >= _FROM_FILE:   # a whole graph: its weights came with it
        module = load_graph(graph.numpy())
    else:   # a skeleton (kilobytes)
        with _torchscript.quiet():
            module = torch.jit.load(io.BytesIO(graph.numpy().tobytes()), map_location="cpu")
    module.eval()
    mapped = None
    if weights is not None:
        directory, name, manifest = weights
        mapped = MappedWeights(module, directory, name, manifest, core, mid)
    return module, tuple(timing), mapped


def _drop(mid: int, models, timings, shared) -> None:
    models.pop(mid, None)
    timings.pop(mid, None)
    weights = shared.pop(mid, None)
    if weights is not None:
        weights.close()


def _warm_torchscript() -> None:
    """Pay TorchScript's first-load costs (building its type and operator tables)
    once, at import, in the forkserver that every worker is forked from: otherwise
    every worker pays them again in its first LOAD, on the CPUs the callers share
    (docs/performance.md, "Figures behind the code's choices").
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
