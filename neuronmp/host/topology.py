"""The host's NeuronCores: how many, how they group into chips, which CPUs back each.

With no Neuron device, cores are emulated, and the topology says what to
emulate:

    NEURONMP_TOPOLOGY=inf1.6xlarge   an instance preset (4 chips x 4 cores)
    NEURONMP_TOPOLOGY=4x4            CHIPSxCORES (physical cores per chip)
    (unset)                          one physical core per CPU this process may run on

    NEURON_LOGICAL_NC_CONFIG=1|2     physical NeuronCores per logical one (trn2
                                     default 2; inf1/inf2/trn1 accept only 1)

The runtime, and so every layer above this one, sees logical cores: on a
trn2.48xlarge, 16 chips x 8 physical NeuronCore-v3 are 64 logical cores with
the default config 2, or 128 with 1.  Logical core ``k`` groups physical cores
``k*lnc .. k*lnc+lnc-1``; the physical grouping is kept as extra attributes.

    preset / grid  --physical cores per chip--.
    NEURON_LOGICAL_NC_CONFIG ----------------- +--> logical cores --> CPUs (map_cpus)

Every emulated (logical) core is backed by CPUs: with at least as many CPUs as
cores, each core gets a contiguous share of them; with more cores than CPUs,
cores wrap around the CPUs, so neighbouring cores (which a NEURON_RT_NUM_CORES
block takes together) land on different CPUs.

Imports no torch: launchers and inventory tools read this in milliseconds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from ..errors import ConfigError, TopologyError

ENV_TOPOLOGY = "NEURONMP_TOPOLOGY"
ENV_LNC = "NEURON_LOGICAL_NC_CONFIG"

_GIB = 1 << 30


@dataclass(frozen=True)
class Instance:
    """An instance type's Neuron devices, as its specification describes them.

    ``lnc`` lists the logical NeuronCore configs the instance accepts, its
    default first; ``links`` names how its devices connect (``chain``: Inferentia
    NeuronLink-v1, ``ring``: Inferentia2, ``torus``: the 4x4 2D torus of trn1/trn2).
    """

    chips: int
    physical_cores_per_chip: int
    device_memory: int
    links: str
    lnc: Tuple[int, ...] = (1,)


#: instance type -> its devices, from the instances' specifications.
PRESETS: Dict[str, Instance] = {
    "inf1.xlarge": Instance(1, 4, 8 * _GIB, "chain"),
    "inf1.2xlarge": Instance(1, 4, 8 * _GIB, "chain"),
    "inf1.6xlarge": Instance(4, 4, 8 * _GIB, "chain"),
    "inf1.24xlarge": Instance(16, 4, 8 * _GIB, "chain"),
    "inf2.xlarge": Instance(1, 2, 32 * _GIB, "ring"),
    "inf2.8xlarge": Instance(1, 2, 32 * _GIB, "ring"),
    "inf2.24xlarge": Instance(6, 2, 32 * _GIB, "ring"),
    "inf2.48xlarge": Instance(12, 2, 32 * _GIB, "ring"),
    "trn1.2xlarge": Instance(1, 2, 32 * _GIB, "torus"),
    "trn1.32xlarge": Instance(16, 2, 32 * _GIB, "torus"),
    "trn2.3xlarge": Instance(1, 8, 96 * _GIB, "torus", lnc=(2, 1)),
    "trn2.48xlarge": Instance(16, 8, 96 * _GIB, "torus", lnc=(2, 1)),
}

_MAX_CORES = 4096  # a sanity bound for CHIPSxCORES typos such as 4x4000
_GRID_MEMORY = 32 * _GIB  # a grid's devices: a trn1/inf2-sized device


@dataclass(frozen=True)
class Topology:
    """An emulated Neuron host, in the logical cores the runtime shows.

    ``name`` is the preset or ``CHIPSxCORES`` (``"cpus"`` when derived from
    the CPU affinity); ``cores_per_chip`` counts logical cores; ``core_cpus[i]``
    the CPUs backing global (logical) core ``i``; ``lnc`` the physical cores
    per logical one and ``lnc_choices`` the configs this host accepts, its
    default first; ``device_memory`` bytes per chip; ``links`` how chips connect.
    """

    name: str
    chips: int
    cores_per_chip: int
    core_cpus: Tuple[Tuple[int, ...], ...]
    lnc: int = 1
    lnc_choices: Tuple[int, ...] = (1,)
    device_memory: int = _GRID_MEMORY
    links: str = "ring"

    @property
    def num_cores(self) -> int:
        return self.chips * self.cores_per_chip

    @property
    def physical_cores_per_chip(self) -> int:
        return self.cores_per_chip * self.lnc

    @property
    def num_physical_cores(self) -> int:
        return self.num_cores * self.lnc

    def chip_of(self, core: int) -> int:
        self._check(core)
        return core // self.cores_per_chip

    def cpus_of(self, core: int) -> Tuple[int, ...]:
        self._check(core)
        return self.core_cpus[core]

    def physical_cores_of(self, core: int) -> Tuple[int, ...]:
        """The instance-wide ids of the physical NeuronCores logical ``core`` groups."""
        self._check(core)
        return tuple(range(core * self.lnc, (core + 1) * self.lnc))

    def cores_of_chip(self, chip: int) -> Tuple[int, ...]:
        """The global (logical) core ids on ``chip``, ascending."""
        self._check_chip(chip)
        return tuple(range(chip * self.cores_per_chip, (chip + 1) * self.cores_per_chip))

    def connected_to(self, chip: int) -> Optional[Tuple[int, ...]]:
        """The chips ``chip`` links to directly; None on a one-chip host (as neuron-ls)."""
        self._check_chip(chip)
        if self.chips == 1:
            return None
        return _LINKS.get(self.links, _ring)(chip, self.chips)

    def _check(self, core: int) -> None:
        if not 0 <= core < self.num_cores:
            raise IndexError(
                f"core {core} is not on this host ({self.name}: cores 0-{self.num_cores - 1})"
            )

    def _check_chip(self, chip: int) -> None:
        if not 0 <= chip < self.chips:
            raise IndexError(
                f"chip {chip} is not on this host ({self.name}: chips 0-{self.chips - 1})"
            )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "chips": self.chips,
            "cores_per_chip": self.cores_per_chip,
            "num_cores": self.num_cores,
            "lnc": self.lnc,
            "physical_cores_per_chip": self.physical_cores_per_chip,
            "num_physical_cores": self.num_physical_cores,
            "device_memory": self.device_memory,
            "core_cpus": [list(c) for c in self.core_cpus],
        }


def _unique(chip: int, candidates: Sequence[int]) -> Tuple[int, ...]:
    out = []
    for c in candidates:
        if c != chip and c not in out:
            out.append(c)
    return tuple(out)


def _chain(chip: int, chips: int) -> Tuple[int, ...]:
    return _unique(chip, [c for c in (chip + 1, chip - 1) if 0 <= c < chips])


def _ring(chip: int, chips: int) -> Tuple[int, ...]:
    return _unique(chip, [(chip - 1) % chips, (chip + 1) % chips])


def _torus(chip: int, chips: int) -> Tuple[int, ...]:
    # rows of 4 with wrap-around both ways; neuron-ls lists up, left, down, right
    width = 4
    if chips % width or chips <= width:
        return _ring(chip, chips)
    rows = chips // width
    r, c = divmod(chip, width)
    return _unique(chip, [((r - 1) % rows) * width + c, r * width + (c - 1) % width,
                          ((r + 1) % rows) * width + c, r * width + (c + 1) % width])


_LINKS: Dict[str, Callable[[int, int], Tuple[int, ...]]] = {
    "chain": _chain, "ring": _ring, "torus": _torus,
}


def map_cpus(num_cores: int, cpus: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """Assign CPUs to cores: contiguous shares, or wrapping when cores outnumber CPUs.

    With 2 cores on 5 CPUs the shares are (0, 1) and (2, 3, 4): the remainder
    goes to the last cores, so every CPU backs exactly one core.
    """
    cpus = sorted(cpus)
    if not cpus:
        raise ValueError("no CPUs to back the cores")
    n, m = num_cores, len(cpus)
    if n > m:
        return tuple((cpus[i % m],) for i in range(n))
    return tuple(tuple(cpus[i * m // n:(i + 1) * m // n]) for i in range(n))


def available_cpus() -> Tuple[int, ...]:
    """The CPUs this process may run on (its affinity), ascending."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux; keep working for inventory purposes
        return tuple(range(os.cpu_count() or 1))


def parse(spec: Optional[str], cpus: Optional[Sequence[int]] = None,
          lnc: Union[str, int, None] = None) -> Topology:
    """Build a topology from a NEURONMP_TOPOLOGY value (None or empty: from the CPUs).

    ``lnc`` is a NEURON_LOGICAL_NC_CONFIG value (None or empty: the host's default).
    """
    cpus = tuple(cpus) if cpus is not None else available_cpus()
    spec = (spec or "").strip()
    if not spec:
        return _build("cpus", 1, len(cpus), cpus, lnc, _grid_lnc(len(cpus)), _GRID_MEMORY, "ring")
    key = spec.lower()
    if key in PRESETS:
        i = PRESETS[key]
        return _build(key, i.chips, i.physical_cores_per_chip, cpus, lnc, i.lnc,
                      i.device_memory, i.links)
    chips, per = _parse_grid(spec)
    return _build(f"{chips}x{per}", chips, per, cpus, lnc, _grid_lnc(per), _GRID_MEMORY, "ring")


def _build(name: str, chips: int, physical: int, cpus: Sequence[int], lnc, choices,
           memory: int, links: str) -> Topology:
    value = parse_lnc(lnc, name, choices)
    per = physical // value
    return Topology(name, chips, per, map_cpus(chips * per, cpus), value, tuple(choices),
                    memory, links)


def _grid_lnc(physical_per_chip: int) -> Tuple[int, ...]:
    # a grid or the CPU-derived host groups pairs when its chips split evenly into them
    return (1, 2) if physical_per_chip % 2 == 0 else (1,)


def parse_lnc(value: Union[str, int, None], name: str, choices: Sequence[int]) -> int:
    """A NEURON_LOGICAL_NC_CONFIG value checked against what host ``name`` accepts."""
    text = "" if value is None else str(value).strip()
    if not text:
        return choices[0]
    accepted = _lnc_accepted(name, choices)
    if text not in ("1", "2"):
        raise ConfigError(ENV_LNC, str(value), "the logical NeuronCore config is the number "
                          "of physical NeuronCores per logical one, 1 or 2", accepted)
    if int(text) not in choices:
        raise ConfigError(ENV_LNC, str(value), f"{name} has no logical NeuronCores of "
                          f"{text} physical cores", accepted)
    return int(text)


def _lnc_accepted(name: str, choices: Sequence[int]) -> str:
    here = " or ".join(str(c) for c in sorted(choices))
    return (f"{here} on {name} (default {choices[0]}); 2 is the trn2 default and also "
            "works on CHIPSxCORES grids with an even core count; inf1, inf2 and trn1 accept "
            "only 1")


def _parse_grid(spec: str) -> Tuple[int, int]:
    parts = spec.lower().split("x")
    accepted = sorted(PRESETS)
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise TopologyError(spec, accepted)
    chips, per = (int(p) for p in parts)
    if chips < 1 or per < 1 or chips * per > _MAX_CORES:
        raise TopologyError(spec, accepted)
    return chips, per


def from_env(env: Mapping[str, str]) -> Topology:
    """The topology of ``NEURONMP_TOPOLOGY`` and ``NEURON_LOGICAL_NC_CONFIG`` in ``env``
    (the grammar; this process's is ``settings.get("topology")``)."""
    return parse(env.get(ENV_TOPOLOGY), lnc=env.get(ENV_LNC))
