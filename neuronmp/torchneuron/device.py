"""``torch.neuron``: the device module TorchNeuron registers, on neuronmp's runtime.

    torch.neuron.<fn>            this module (torch._register_device_module)
      device_count               visible logical cores, from the environment until the
                                 runtime starts, then the cores it reserved
      first device use  ──▶ _lazy_init ──▶ neuronmp.runtime.init() (cores reserved
                                 exclusively; a forked child is refused)
      memory statistics ──▶ the C++ allocator's per-device byte counts
      shared_block      ──▶ where a big tensor lives for a peer to map (a memfd)
      seeds / RNG state ──▶ one CPU generator per device index (C++)

Execution is synchronous (every op has finished when it returns), so streams and
events are TorchNeuron's without HostCC: every stream is the device's default stream,
``synchronize`` only starts the runtime, and an event's time is when it was recorded.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Any, Dict, List, Optional, Union

import torch

from ..errors import NeuronForkError
from . import _ext

Device = Union[int, str, torch.device, None]

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
    from .. import settings

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
        from .. import runtime

        rt = runtime.init()
        if c.own_index() < 0:   # a rank keeps its job-wide numbering (attach_rank)
            c.set_count(len(rt.cores))
        rt.add_shutdown_hook(c.mark_unready)   # a later use starts a runtime again
        c.mark_ready()


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

    if visible_count() != 1:
        raise VisibilityError(
            "NEURON_RT_VISIBLE_CORES", os.environ.get("NEURON_RT_VISIBLE_CORES", ""),
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


def set_device(device: Device) -> None:
    """Make ``device`` this thread's current device (an index past the visible
    cores raises, naming the valid range)."""
    index = _index(device, optional=False)
    if index >= 0:
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


def get_device_name(device: Device = None) -> str:
    return f"neuron:{_index(device)}"


class _DeviceProperties(collections.namedtuple("_DeviceProperties", "name total_memory")):
    """What ``get_device_properties`` reports: the core's name and its share of HBM."""


def get_device_properties(device: Device = None) -> _DeviceProperties:
    from .. import settings

    index = _index(device)
    _lazy_init()
    # the range only, as TorchNeuron: a rank may ask about its peers' devices
    if not 0 <= index < device_count():
        raise ValueError(f"Invalid device id: {index}")
    topo = settings.get("topology")
    return _DeviceProperties(f"neuron:{index}", topo.device_memory // topo.cores_per_chip)


# -- random numbers ---------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    _c().manual_seed(current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def _own_indices() -> List[int]:
    """The indices this process may touch: all, or a rank's own one (attach_rank), so
    torch.manual_seed in a rank of a distributed job seeds its device, not its peers'."""
    own = _c().own_index()
    return [own] if own >= 0 else list(range(device_count()))


def manual_seed_all(seed: int) -> None:
    for i in _own_indices():
        _c().manual_seed(i, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def seed() -> None:
    _c().seed(current_device())


def seed_all() -> None:
    for i in _own_indices():
        _c().seed(i)


def initial_seed() -> int:
    return _c().initial_seed(current_device())


def get_rng_state(device: Device = "neuron") -> torch.Tensor:
    return _c().get_rng_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: Device = "neuron") -> None:
    _c().set_rng_state(_index(device), new_state)


def get_rng_state_all() -> List[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: List[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


# -- autocast -------------------------------------------------------------------------


def get_amp_supported_dtype() -> List[torch.dtype]:
    return [torch.float32, torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


# -- memory -----------------------------------------------------------------------------


def memory_stats(device: Device = None) -> Dict[str, int]:
    """Byte and allocation counts of the device's tensors (no caching allocator:
    reserved equals allocated, and ``empty_cache`` has nothing to return)."""
    raw = dict(_c().memory_stats(_index(device)))
    for kind in ("current", "peak", "allocated", "freed"):
        raw[f"reserved_bytes.all.{kind}"] = raw[f"allocated_bytes.all.{kind}"]
    return collections.OrderedDict(sorted(raw.items()))


def memory_allocated(device: Device = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Device = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Device = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Device = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Device = None) -> None:
    _c().reset_peak(_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
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


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    stats = memory_stats(device)
    lines = [f"neuron:{_index(device)} memory (neuronmp emulation)"]
    lines += [f"  {k}: {v}" for k, v in stats.items()]
    return "\n".join(lines)


# -- streams and events -----------------------------------------------------------------


class Stream(torch.Stream):
    """A neuron stream; without HostCC every stream is the device's default stream."""

    def __new__(cls, device: Device = None, priority: int = 0, **kwargs: Any):
        return super().__new__(cls, device=torch.device("neuron", _index(device)),
                               priority=priority, **kwargs)


def Event(enable_timing: bool = False, blocking: bool = False,
          interprocess: bool = False) -> torch.Event:
    """A neuron event (a ``torch.Event`` of the current device: torch's event methods
    accept only that exact type); recorded when the work before it is done, at once here."""
    return torch.Event(device=torch.device("neuron", current_device()),
                       enable_timing=enable_timing, blocking=blocking,
                       interprocess=interprocess)


def current_stream(device: Device = None) -> Stream:
    return Stream(device)


def default_stream(device: Device = None) -> Stream:
    return Stream(device)


def set_stream(stream: Optional[torch.Stream]) -> None:
    """Accepted for TorchNeuron's API: every stream is the default stream."""


class stream:
    """Context manager selecting ``stream`` (the default stream: see the module)."""

    def __init__(self, stream: Optional[torch.Stream]):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc: Any) -> bool:
        return False


def _sleep(cycles: int) -> None:
    """TorchNeuron's test helper: nothing to wait for here."""


memory = None  # set by neuronmp.torchneuron.register: torch.neuron.memory is this module
