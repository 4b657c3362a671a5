"""Which cores this process may use, and how it numbers them.

The rules are the Neuron runtime's:

    NEURON_RT_VISIBLE_CORES  "3" | "0-6" | "2,3" | "3-5,6"   (instance-wide ids;
                             the set must be contiguous and ascending)
    NEURON_RT_NUM_CORES      "n": any free contiguous block of n; 0 = all
    both set                 VISIBLE_CORES wins
    neither                  every core on the host

Inside the process cores are renumbered from zero: with
``NEURON_RT_VISIBLE_CORES=7-15``, ``nc:0`` is global core 7.  The helpers here
translate between the two numberings and validate ``device_ids`` entries.

What a process *asks* for (a :class:`Request`) is decided here; which cores it
*gets* for a count is decided by the reservation layer, which knows what other
processes hold.  Imports no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import DeviceIdError, VisibilityError
from . import envconfig
from .spans import span  # noqa: F401  (re-exported: visibility.span)
from .topology import Topology

ENV_VISIBLE = "NEURON_RT_VISIBLE_CORES"
ENV_NUM = "NEURON_RT_NUM_CORES"

VISIBLE_ACCEPTED = (
    "a core index ('3'), an inclusive range ('0-6'), or a comma list of them "
    "('2,3', '3-5,6') naming contiguous cores in ascending order"
)
NUM_ACCEPTED = "a whole number of cores, 0 (all) up to the host's core count"

#: ASCII digits only: \d would take any script's digits (and int() would read them)
_RANGE = re.compile(r"([0-9]+)(?:[ \t]*-[ \t]*([0-9]+))?")
#: Cores any value may name; hosts are smaller (topology caps CHIPSxCORES at 4096).
MAX_CORES = 1 << 16
_DIGITS = 12
_HUGE = 10 ** _DIGITS


@dataclass(frozen=True)
class Request:
    """What a process asks the runtime for.

    Exactly one form holds: ``cores`` (explicit global ids), or ``count``
    (any contiguous free block of that size), or neither (every core).
    """

    cores: Optional[Tuple[int, ...]] = None
    count: Optional[int] = None
    source: str = ""

    def describe(self) -> str:
        if self.cores is not None:
            return f"{ENV_VISIBLE}={self.source}"
        if self.count is not None:
            return f"{ENV_NUM}={self.count}"
        return "all cores"


def parse_visible_cores(value: str, num_cores: Optional[int] = None) -> Tuple[int, ...]:
    """Parse a NEURON_RT_VISIBLE_CORES value into ascending global core ids.

    Every bound is checked on the numbers before a core list is built, so
    ``0-99999999999`` is refused in microseconds instead of filling memory.
    """

    def refuse(reason: str) -> VisibilityError:
        shown = value if len(value) <= 80 else value[:77] + "..."
        return VisibilityError(ENV_VISIBLE, shown, reason, _with_host(VISIBLE_ACCEPTED, num_cores))

    if not value.strip():
        raise refuse("the value is empty")
    limit = num_cores if num_cores is not None else MAX_CORES
    spans: List[Tuple[int, int]] = []
    for entry in value.split(","):
        lo, hi = _entry(entry.strip(), refuse)
        if spans and lo <= spans[-1][1]:
            raise refuse(f"{entry.strip()!r} overlaps or comes before core {spans[-1][1]}")
        if spans and lo != spans[-1][1] + 1:
            raise refuse(f"Neuron cores are not contiguous (core {spans[-1][1]} then {lo})")
        if hi >= limit:
            raise refuse(f"core {_number(hi)} is beyond this host's {limit} cores"
                         if num_cores is not None else
                         f"core {_number(hi)} is beyond the {MAX_CORES} cores neuronmp handles")
        spans.append((lo, hi))
    return tuple(range(spans[0][0], spans[-1][1] + 1))


def _entry(entry: str, refuse) -> Tuple[int, int]:
    """One comma-separated entry as (first, last), both checked only for form here."""
    if not entry:
        raise refuse("it has an empty entry")
    m = _RANGE.fullmatch(entry)
    if not m:
        raise refuse(f"{entry!r} is not a core index or a range of them")
    lo = _core_number(m.group(1))
    hi = _core_number(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise refuse(f"the range {entry!r} is reversed")
    return lo, hi


def _core_number(digits: str) -> int:
    # past _DIGITS digits the exact value cannot matter (it is beyond any host) and
    # int() of a very long string is slow, then refused (Python's 4300-digit limit)
    return int(digits) if len(digits) <= _DIGITS else _HUGE


def _number(n: int) -> str:
    return f"with more than {_DIGITS} digits" if n == _HUGE else str(n)


def parse_num_cores(value: str, num_cores: Optional[int] = None) -> int:
    """Parse a NEURON_RT_NUM_CORES value; 0 means all cores."""
    accepted = _with_host(NUM_ACCEPTED, num_cores)
    count = envconfig.parse_integer(ENV_NUM, value, 0, _HUGE, accepted=accepted,
                                    error=VisibilityError)
    if num_cores is not None and count > num_cores:
        raise VisibilityError(ENV_NUM, value, f"this host has only {num_cores} cores", accepted)
    if count > MAX_CORES:
        raise VisibilityError(ENV_NUM, value, f"neuronmp handles at most {MAX_CORES} cores",
                              accepted)
    return count


def _with_host(accepted: str, num_cores: Optional[int]) -> str:
    if num_cores is None:
        return accepted
    return f"{accepted}; this host has {num_cores} cores (0-{num_cores - 1})"


def request_from_env(topology: Topology, env: Mapping[str, str]) -> Request:
    """What a process with environment ``env`` asks for (VISIBLE_CORES wins); this
    process's is ``settings.get("request")``.

    Under plain torchrun (see :func:`torchrun_share`) the request is this
    rank's share of the visible cores instead of all of them.
    """
    share = torchrun_share(topology, env)
    if share is not None:
        return share
    visible = env.get(ENV_VISIBLE)
    if visible is not None:
        return Request(cores=parse_visible_cores(visible, topology.num_cores), source=visible)
    num = env.get(ENV_NUM)
    if num is not None and num.strip() != "":
        count = parse_num_cores(num, topology.num_cores)
        if count:
            return Request(count=count, source=num)
    return Request()


# -- ranks started by plain torchrun -------------------------------------------

#: set by neuronmp-run in the ranks it starts: their cores are already sliced,
#: so the torchrun narrowing below must not slice them a second time.
ENV_SLICED_BY = "NEURONMP_SLICED_BY"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def torchrun_share(topology: Topology, environ: Mapping[str, str]) -> Optional[Request]:
    """This rank's cores when started by torchrun, as torch-neuronx assigns them.

    Applies when ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set and the
    process was not started by neuronmp-run (``NEURONMP_SLICED_BY``); returns
    None otherwise.

        NEURON_RT_VISIBLE_CORES unset   rank i gets core i (torch-neuronx's rule)
        NEURON_RT_VISIBLE_CORES=V       V is cut into LOCAL_WORLD_SIZE equal
                                        contiguous shares, rank i takes share i
                                        (with one entry per rank: entry i,
                                        torch-neuronx's rule)

    Counts that do not fit raise VisibilityError naming both numbers.
    """
    if environ.get(ENV_SLICED_BY):
        return None
    rank_text = environ.get(ENV_LOCAL_RANK)
    size_text = environ.get(ENV_LOCAL_WORLD_SIZE)
    if rank_text is None or size_text is None:
        return None
    rank, size = local_rank_and_size(rank_text, size_text)
    visible = environ.get(ENV_VISIBLE)
    where = f"{ENV_LOCAL_RANK}={rank} of {ENV_LOCAL_WORLD_SIZE}={size}"
    if visible is None:
        return _core_of_rank(rank, size, topology.num_cores, where)
    cores = parse_visible_cores(visible, topology.num_cores)
    if len(cores) % size:
        raise VisibilityError(
            ENV_VISIBLE, visible,
            f"under torchrun its {len(cores)} core(s) must split evenly among "
            f"{ENV_LOCAL_WORLD_SIZE}={size} ranks ({len(cores)} = {size} x "
            f"{len(cores) // size} + {len(cores) % size})",
            f"a multiple of {ENV_LOCAL_WORLD_SIZE}={size} cores, one contiguous share per rank",
        )
    per = len(cores) // size
    share = cores[rank * per:(rank + 1) * per]
    return Request(cores=share, source=f"{span(share)} ({where}, share of {visible})")


def local_rank_and_size(rank_text: str, size_text: str) -> Tuple[int, int]:
    """torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE texts as whole numbers, rank < size."""
    accepted = f"whole numbers with 0 <= {ENV_LOCAL_RANK} < {ENV_LOCAL_WORLD_SIZE}"
    size = envconfig.parse_integer(ENV_LOCAL_WORLD_SIZE, size_text, 1, MAX_CORES,
                                   accepted=accepted, error=VisibilityError)
    rank = envconfig.parse_integer(ENV_LOCAL_RANK, rank_text, 0, MAX_CORES,
                                   accepted=accepted, error=VisibilityError)
    if rank >= size:
        raise VisibilityError(ENV_LOCAL_RANK, rank_text,
                              f"it is not below {ENV_LOCAL_WORLD_SIZE}={size}", accepted)
    return rank, size


def _core_of_rank(rank: int, size: int, num_cores: int, where: str) -> Request:
    if size > num_cores:
        raise VisibilityError(
            ENV_LOCAL_WORLD_SIZE, str(size),
            f"with {ENV_VISIBLE} unset each torchrun rank takes the core of its "
            f"{ENV_LOCAL_RANK}, but {ENV_LOCAL_WORLD_SIZE}={size} ranks exceed this "
            f"host's {num_cores} cores",
            f"at most {num_cores} ranks per host, or set {ENV_VISIBLE} to a multiple of "
            f"{ENV_LOCAL_WORLD_SIZE} cores",
        )
    return Request(cores=(rank,), source=f"{rank} ({where}, {ENV_VISIBLE} unset)")


def candidate_blocks(request: Request, num_cores: int) -> Sequence[range]:
    """The core sets that would satisfy ``request``, in the order to try them.

    Each is a range (contiguous, ascending; nothing is materialised, so a count
    on a 4096-core host costs nothing), and their first cores ascend.
    """
    if request.cores is not None:
        return [range(request.cores[0], request.cores[-1] + 1)] if request.cores else []
    if request.count is not None:
        n = request.count
        return [range(s, s + n) for s in range(0, num_cores - n + 1)]
    return [range(num_cores)]


# -- per-process zero-based indexing -------------------------------------------

DeviceId = Union[int, str]


def parse_device_id(device_id: DeviceId) -> int:
    """Turn a ``device_ids`` entry (an int or ``'nc:#'``) into a local index."""
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        index = device_id
    elif isinstance(device_id, str) and re.fullmatch(r"nc:[0-9]+", device_id.strip()):
        index = _core_number(device_id.strip()[3:])
    else:
        raise DeviceIdError(
            device_id, f"Expected `nc:#` or an integer, but got: {device_id!r}"
        )
    if index < 0:
        raise DeviceIdError(
            device_id, f"NeuronCore index must not be negative, but got: {device_id!r}"
        )
    return index


def local_to_global(device_id: DeviceId, visible: Sequence[int]) -> int:
    """Map this process's ``nc:i`` (or ``i``) to the instance-wide core id."""
    index = parse_device_id(device_id)
    if index >= len(visible):
        raise DeviceIdError(device_id, _out_of_range(device_id, visible))
    return visible[index]


def global_to_local(core: int, visible: Sequence[int]) -> int:
    """Map an instance-wide core id to this process's zero-based index."""
    try:
        return list(visible).index(core)
    except ValueError:
        raise DeviceIdError(
            core, f"global NeuronCore {core} is not visible to this process "
            f"(visible: {span(visible)})"
        ) from None


def _out_of_range(device_id: DeviceId, visible: Sequence[int]) -> str:
    return (
        f"NeuronCore {device_id!r} is out of range: this process sees {len(visible)} "
        f"NeuronCore(s), nc:0-nc:{len(visible) - 1} (global {span(visible)})"
        if visible else f"NeuronCore {device_id!r} is out of range: this process sees no cores"
    )
