"""``torch.neuron``: the device module TorchNeuron registers, on neuronmp's runtime.

    torch.neuron.<fn>            this module (torch._register_device_module)
      device_count               visible logical cores, from the environment until the
                                 runtime starts, then the cores it reserved
      first device use  ──▶ _lazy_init ──▶ neuronmp.host.runtime.init() (cores reserved
                                 exclusively; a forked child is refused)
      memory statistics ──▶ the C++ allocator's per-device byte counts
      shared_block      ──▶ where a big tensor lives for a peer to map (a memfd)
      seeds / RNG state ──▶ one TorchNeuron-style generator per device index (C++);
                            random ops draw from the CPU's default generator

Execution is synchronous (every op has finished when it returns): a stream is only
its id (the default stream's unless ``NEURON_RT_ENABLE_HOST_CC=1``, as in TorchNeuron;
the current one per thread and device, kept by the C++ guard), ``synchronize`` only
starts the runtime, and an event's time is when it was recorded.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Union

import torch

from ..errors import NeuronForkError
from . import _ext

Device = Union[int, str, torch.device, None]

log = logging.getLogger(__name__)

_init_lock = threading.RLock()
_ext_module = None


def _c():
    global _ext_module
    if _ext_module is None:
        _ext_module = _ext.load()
    return _ext_module


# -- lifecycle ----------------------------------------------------------------------


def visible_count() -> int:
    """How many logical cores this process may use, from its environment
    (NEURON_RT_VISIBLE_CORES, NEURON_RT_NUM_CORES, NEURON_LOGICAL_NC_CONFIG)."""
    from ..host import settings

    topo, request = settings.get("topology"), settings.get("request")
    if request.cores is not None:
        return len(request.cores)
    return request.count or topo.num_cores


def _lazy_init() -> None:
    """Start the runtime at first device use: the visible cores are reserved for
    this process alone (a second process gets the runtime's refusal naming us)."""
    c = _c()
    if c.is_ready():
        return
    with _init_lock:
        if c.is_ready():
            return
        if c.is_in_bad_fork():
            raise NeuronForkError(os.getppid())
        from ..host import runtime

        rt = runtime.init()
        if c.own_index() < 0:   # a rank keeps its job-wide numbering (attach_rank)
            c.set_count(len(rt.cores))
        rt.add_shutdown_hook(c.mark_unready)   # a later use starts a runtime again
        rt.add_shutdown_hook(_drain_autograd_threads)   # runs first: the device still up
        c.mark_ready()


# torch's backward stashes a Python object in the GraphTask's thread-local state, and
# the engine's device thread ("pt_autograd_<i>") often drops the last reference to a
# finished GraphTask just after the caller's backward returned: that takes the GIL.
# If the interpreter is finalizing by then, Python ends the thread with pthread_exit,
# whose unwind through the engine's noexcept frames calls std::terminate (rc -6,
# "terminate called without an active exception").  A device thread runs its queue in
# order and disposes each task before popping the next, so one tiny backward per
# device thread, whose own task holds no Python object, waits out the one it holds
# (a backward still queued behind ours, from another thread, is not waited for).
# Its task returns no gradients: a task's future holds the tensors it returns, and
# the device thread dropping them after the caller has their Python objects takes
# the GIL again (CI saw the drain's own task abort so); it accumulates into its leaf.
_DRAIN_TIMEOUT = 5.0
_drained: List[Any] = []   # the last drain's tensors: never freed by a device thread


def _autograd_thread_devices() -> List[int]:
    found = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue   # the thread ended meanwhile
        if name.startswith("pt_autograd_") and name[12:].isdigit():
            found.append(int(name[12:]))
    return sorted(found)


def _flush_device_queues(devices: List[int]) -> None:
    try:
        _flush(devices)
    except Exception:   # shutdown goes on; the abort this guards against may follow
        log.exception("could not wait for autograd's device threads %s", devices)


def _flush(devices: List[int]) -> None:
    kept: List[Any] = []
    with torch.enable_grad(), torch.inference_mode(False):
        for i in devices:
            leaf = torch.zeros((), device=f"neuron:{i}", requires_grad=True)
            out = leaf * 1.0
            seed = torch.ones((), device=f"neuron:{i}")
            kept.append((leaf, out, seed))
            # the engine directly: torch.autograd's wrapper stashes the Python context
            # in the task, which would put this task's disposal back on the GIL; and
            # accumulated (into leaf.grad, on the device thread), nothing returned
            torch.autograd.Variable._execution_engine.run_backward(
                (out,), (seed,), False, False, (), False, True)
    # an earlier drain's tasks are gone now (these ran after them): its tensors may go
    _drained[:] = kept


def _drain_autograd_threads() -> None:
    """Wait (bounded) until the engine's neuron device threads hold no finished task."""
    c = _c()
    own = c.own_index()   # a rank's tensors live on its own device only (attach_rank)
    devices = [i for i in _autograd_thread_devices()
               if (i == own if own >= 0 else i < c.device_count())]
    if not devices:
        return
    try:
        worker = threading.Thread(target=_flush_device_queues, args=(devices,),
                                  name="neuronmp-autograd-drain", daemon=True)
        worker.start()
    except RuntimeError:   # no new threads at this stage of shutdown: wait here
        _flush_device_queues(devices)
        return
    worker.join(_DRAIN_TIMEOUT)
    if worker.is_alive():
        log.warning("autograd device threads still busy after %.0f s at shutdown; "
                    "exiting now may abort the process", _DRAIN_TIMEOUT)


def init() -> None:
    """Start the runtime now rather than at first device use."""
    _lazy_init()


def is_initialized() -> bool:
    return _c().is_ready()


def _is_in_bad_fork() -> bool:
    return _c().is_in_bad_fork()


# -- devices --------------------------------------------------------------------------


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    """Visible logical cores: ``neuron:0`` .. ``neuron:{device_count() - 1}``."""
    c = _c()
    if not c.is_ready() and c.own_index() < 0:
        c.set_count(visible_count())   # the environment may have changed since import
    return c.device_count()


def attach_rank(local_rank: int, local_world_size: int) -> None:
    """Number devices as TorchNeuron does in a rank of a distributed job (its process
    group calls this at init_process_group): ``device_count()`` is the local world
    size, the current device is ``neuron:<local_rank>``, and that is the only index
    this process may use (its one visible core); any other raises "Attempted to access
    device that doesn't attach to this process"."""
    from ..errors import VisibilityError
    from ..host import settings
    from ..host.spans import span

    if visible_count() != 1:
        raise VisibilityError(
            "NEURON_RT_VISIBLE_CORES", span(settings.get("visible_cores") or (), none=""),
            f"a rank of a distributed job sees {visible_count()} cores (Attempted to have "
            "more than one device per process in distributed setup)",
            "one core per rank, e.g. NEURON_RT_VISIBLE_CORES=<the rank's core>")
    _c().attach_rank(int(local_rank), int(local_world_size))


def attached_rank() -> Optional[int]:
    """The local rank this process was attached to (``attach_rank``), or None."""
    own = _c().own_index()
    return own if own >= 0 else None


def core_index(index: int) -> int:
    """This process's core (``nc:i``, local numbering) behind device index ``index``."""
    own = _c().own_index()
    return 0 if own >= 0 else index


def _index(device: Device, optional: bool = True) -> int:
    if device is None and optional:
        return current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        return current_device() if device.index is None else device.index
    raise TypeError(f"Expected an int, a 'neuron[:i]' string or a torch.device, "
                    f"but got: {device!r}")


def current_device() -> int:
    return _c().current_device()


def _check_settable(index: int) -> None:
    """TorchNeuron's set_device refusals: ValueError, where a tensor op on a bad index
    raises RuntimeError from the device guard."""
    count = device_count()
    if index < 0 or index >= count:
        raise ValueError(f"Invalid device id: {index}. Valid range is 0 to {count - 1}")
    own = _c().own_index()
    if own >= 0 and index != own:   # a rank sees only its own device
        raise ValueError(f"Device index {index} is out of range. Valid range is {own} to "
                         f"{own} for this process")


def set_device(device: Device) -> None:
    """Make ``device`` this thread's current device (None: the current one).  The
    first device any thread of the process sets is the current device of the threads
    that never set one, as in TorchNeuron."""
    index = _index(device)
    _check_settable(index)
    _c().set_device(index)


class device:
    """Context manager: ``device`` is the current device inside the block."""

    def __init__(self, device: Device):
        self.idx = -1 if device is None else _index(device, optional=False)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        if self.idx >= 0:
            _c().set_device(self.prev_idx)
        return False


def synchronize(device: Device = None) -> None:
    """Wait for the device's work: here every op has finished when it returns."""
    _lazy_init()
    _index(device)


def get_device_name(device: Union[int, torch.device] = 0) -> str:
    """``neuron:<i>`` for an index, ``str(device)`` for a torch.device; TorchNeuron
    accepts nothing else."""
    if isinstance(device, torch.device):
        return str(device)
    if isinstance(device, int) and not isinstance(device, bool):
        return f"neuron:{device}"
    raise ValueError("Incorrect device argument found, expected torch.device or int type, "
                     f"found {type(device)}")


class _DeviceProperties(collections.namedtuple("_DeviceProperties", "name total_memory")):
    """What ``get_device_properties`` reports: the core's name and its share of HBM."""


def get_device_properties(device: Device = None) -> _DeviceProperties:
    from ..host import settings

    if isinstance(device, str) and "neuron" in device:
        index = torch.device(device).index or 0
    elif device is None or isinstance(device, torch.device):
        index = _index(device)
    else:
        index = int(device)
    if index < 0 or index >= device_count():
        raise ValueError(f"Invalid device id: {index}")
    _lazy_init()
    # the range only, as TorchNeuron: a rank may ask about its peers' devices
    if not 0 <= index < device_count():
        raise ValueError(f"Invalid device id: {index}")
    topo = settings.get("topology")
    return _DeviceProperties(f"neuron:{index}", topo.device_memory // topo.cores_per_chip)


# -- random numbers ---------------------------------------------------------------------
#
# Each device has a default generator of TorchNeuron's kind (a seed and an offset: 16
# bytes of state) that these functions seed and read.  Random ops on the device do not
# draw from it: as TorchNeuron runs them through its CPU fallback, they use the CPU's
# default generator, so ``torch.manual_seed(s)`` decides their numbers.


def default_generator(device: Device = None) -> torch.Generator:
    """The default generator of ``device`` (the current device by default)."""
    return _c().default_generator(_index(device))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def _own_indices() -> List[int]:
    """The indices this process may touch: all, or a rank's own one (attach_rank), so
    torch.manual_seed in a rank of a distributed job seeds its device, not its peers'."""
    own = _c().own_index()
    return [own] if own >= 0 else list(range(device_count()))


def manual_seed_all(seed: int) -> None:
    for i in _own_indices():
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    """A random seed for the first device, and that same seed for the others."""
    chosen = None
    for i in _own_indices():
        if chosen is None:
            chosen = default_generator(i).seed()
        else:
            default_generator(i).manual_seed(chosen)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: Device = None) -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Device = None) -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> List[torch.Tensor]:
    return [get_rng_state(i) for i in _own_indices()]


def set_rng_state_all(new_states: List[torch.Tensor]) -> None:
    for i, state in zip(_own_indices(), new_states):
        set_rng_state(state, i)


# -- autocast -------------------------------------------------------------------------


def get_amp_supported_dtype() -> List[torch.dtype]:
    return [torch.float32, torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


# -- memory -----------------------------------------------------------------------------


_BYTES = ("current", "peak", "allocated", "freed")


def memory_stats(device: Device = None) -> Dict[str, Any]:
    """TorchNeuron's memory statistics of ``device``: ``allocated_bytes``,
    ``reserved_bytes`` and ``active_bytes`` (each ``current``, ``peak``, ``allocated``,
    ``freed``), ``num_alloc_retries``, ``num_ooms``, ``num_tensor_frees`` and
    ``allocation_requests``.  Nothing is cached, so reserved is 0 and active equals
    allocated, as TorchNeuron reports them; retries and OOMs never happen here."""
    raw = _c().memory_stats(_index(device))
    held = {k: raw[k] for k in _BYTES}
    return {"allocated_bytes": held, "reserved_bytes": dict.fromkeys(_BYTES, 0),
            "active_bytes": dict(held), "num_alloc_retries": 0, "num_ooms": 0,
            "num_tensor_frees": raw["frees"], "allocation_requests": raw["requests"]}


def memory_allocated(device: Device = None) -> int:
    return memory_stats(device)["allocated_bytes"]["current"]


def max_memory_allocated(device: Device = None) -> int:
    return memory_stats(device)["allocated_bytes"]["peak"]


def memory_reserved(device: Device = None) -> int:
    return memory_stats(device)["reserved_bytes"]["current"]


def max_memory_reserved(device: Device = None) -> int:
    return memory_stats(device)["reserved_bytes"]["peak"]


def reset_peak_memory_stats(device: Device = None) -> None:
    """Every peak becomes its current value."""
    _c().reset_peak(_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """The counters (requests, frees, retries, OOMs) and the bytes ever allocated and
    freed go back to zero."""
    _c().reset_accumulated(_index(device))


def empty_cache() -> None:
    """Nothing is cached: freed tensors return their memory at once."""


class SharedBlock(collections.namedtuple("SharedBlock", "fd serial offset size")):
    """Where a neuron tensor's bytes live when a peer process can map them: this
    process's memfd ``fd`` (named ``neuronmp-<serial>``, as /proc/<pid>/fd/<fd> shows
    it), the tensor's first byte at ``offset`` of its ``size`` mapped bytes."""


def shared_block(tensor: torch.Tensor) -> Optional[SharedBlock]:
    """Where ``tensor`` lives if another process can map it, else None.  The device
    allocates blocks of ``shared_min()`` bytes or more as memfds mapped shared (freed
    with the tensor's storage, gone with the process); smaller blocks, and tensors a
    CPU kernel produced, are plain process memory."""
    found = _c().shared_block(tensor)
    return None if found is None else SharedBlock(*found)


def shared_min() -> int:
    """The smallest block the device allocates shareable (see ``shared_block``)."""
    return _c().shared_min()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}"
        n /= 1024
    return ""


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """The statistics as a table headed "Neuron Memory Summary, Device <i>";
    ``abbreviated`` leaves out the reserved and active rows."""
    index = _index(device)
    stats = memory_stats(index)
    rows = [("allocated", "allocated_bytes")]
    if not abbreviated:
        rows += [("reserved", "reserved_bytes"), ("active", "active_bytes")]
    lines = [f"Neuron Memory Summary, Device {index} (neuronmp emulation)",
             f"  requests {stats['allocation_requests']:,}, frees "
             f"{stats['num_tensor_frees']:,}, OOMs {stats['num_ooms']:,}, retries "
             f"{stats['num_alloc_retries']:,}",
             "  " + " | ".join(f"{h:>12}" for h in ("", *_BYTES))]
    for name, key in rows:
        lines.append("  " + " | ".join(
            [f"{name:>12}"] + [f"{_size(stats[key][k]):>12}" for k in _BYTES]))
    return "\n".join(lines)


# -- streams and events -----------------------------------------------------------------


class Stream(torch.Stream):
    """A neuron stream.  As in TorchNeuron, a new stream is the device's default stream
    unless ``NEURON_RT_ENABLE_HOST_CC=1`` (read when the process makes its first stream),
    when each gets an id of its own; work on any of them has finished when it returns."""

    def __new__(cls, device: Device = None, priority: int = 0, **kwargs: Any):
        if {"stream_id", "device_index", "device_type"} <= kwargs.keys():
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", _index(device)),
                               priority=priority, **kwargs)

    def record_event(self, event: Optional[torch.Event] = None) -> torch.Event:
        """Record ``event`` (a new :class:`Event`) on this stream; torch.Stream's own
        takes only a plain ``torch.Event``."""
        event = Event() if event is None else event
        event.record(self)
        return event


#: c10's number for the PrivateUse1 device type, which torch.Stream takes to rebuild one
_PRIVATEUSE1 = 20


def _stream(stream_id: int, index: int) -> Stream:
    return Stream(stream_id=stream_id, device_index=index, device_type=_PRIVATEUSE1)


class Event(torch.Event):
    """A neuron event of the current device, recorded when the work before it is done
    (at once here).  ``elapsed_time`` checks what TorchNeuron checks, in its order and
    with its ``RuntimeError``: both created with timing, both recorded, one device."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False):
        return super().__new__(cls, device=torch.device("neuron", current_device()),
                               enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)

    def elapsed_time(self, end_event: torch.Event) -> float:
        return _c().event_elapsed(self, end_event)


def current_stream(device: Device = None) -> Stream:
    """The calling thread's current stream on ``device`` (the current device)."""
    index = _index(device)
    return _stream(_c().current_stream(index), index)


def default_stream(device: Device = None) -> Stream:
    return _stream(0, _index(device))


def set_stream(stream: Optional[torch.Stream]) -> None:
    """Make ``stream`` the calling thread's current stream on its device (the current
    device stays as it is, as in TorchNeuron); ``None`` changes nothing."""
    if stream is not None:
        _c().set_stream(stream.stream_id, stream.device_index)


class stream:
    """Context manager selecting ``stream`` on its device, the previous current streams
    (of the current device and of the stream's) restored on exit; ``None`` selects
    nothing."""

    def __init__(self, stream: Optional[torch.Stream]):
        self.stream = stream
        self._previous: List[Stream] = []

    def __enter__(self):
        if self.stream is not None:
            here = current_stream()
            self._previous = [here]
            if self.stream.device_index != here.device_index:
                self._previous.insert(0, current_stream(self.stream.device_index))
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: Any) -> bool:
        for previous in self._previous:
            set_stream(previous)
        self._previous = []
        return False


def _sleep(cycles: int) -> None:
    """TorchNeuron's test helper: nothing to wait for here."""


memory = None  # set by neuronmp.torchneuron.register: torch.neuron.memory is this module
