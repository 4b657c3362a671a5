"""The host's NeuronCores: how many, how they group into chips, which CPUs back each.

Layer 1 of neuronmp.  With no Neuron device, cores are emulated, and the
topology says what to emulate:

    NEURONMP_TOPOLOGY=inf1.6xlarge   an instance preset (4 chips x 4 cores)
    NEURONMP_TOPOLOGY=4x4            CHIPSxCORES
    (unset)                          one core per CPU this process may run on

Every emulated core is backed by CPUs: with at least as many CPUs as cores,
each core gets a contiguous share of them; with more cores than CPUs, cores
wrap around the CPUs, so neighbouring cores (which a NEURON_RT_NUM_CORES block
takes together) land on different CPUs.

Imports no torch: launchers and inventory tools read this in milliseconds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from .errors import TopologyError

ENV_TOPOLOGY = "NEURONMP_TOPOLOGY"

#: instance type -> (chips, cores per chip), from the instances' specifications.
PRESETS = {
    "inf1.xlarge": (1, 4),
    "inf1.2xlarge": (1, 4),
    "inf1.6xlarge": (4, 4),
    "inf1.24xlarge": (16, 4),
    "inf2.xlarge": (1, 2),
    "inf2.8xlarge": (1, 2),
    "inf2.24xlarge": (6, 2),
    "inf2.48xlarge": (12, 2),
    "trn1.2xlarge": (1, 2),
    "trn1.32xlarge": (16, 2),
}

_MAX_CORES = 4096  # a sanity bound for CHIPSxCORES typos such as 4x4000


@dataclass(frozen=True)
class Topology:
    """An emulated Neuron host.

    ``name`` is the preset or ``CHIPSxCORES`` (``"cpus"`` when derived from
    the CPU affinity); ``core_cpus[i]`` the CPUs backing global core ``i``.
    """

    name: str
    chips: int
    cores_per_chip: int
    core_cpus: Tuple[Tuple[int, ...], ...]

    @property
    def num_cores(self) -> int:
        return self.chips * self.cores_per_chip

    def chip_of(self, core: int) -> int:
        self._check(core)
        return core // self.cores_per_chip

    def cpus_of(self, core: int) -> Tuple[int, ...]:
        self._check(core)
        return self.core_cpus[core]

    def _check(self, core: int) -> None:
        if not 0 <= core < self.num_cores:
            raise IndexError(
                f"core {core} is not on this host ({self.name}: cores 0-{self.num_cores - 1})"
            )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "chips": self.chips,
            "cores_per_chip": self.cores_per_chip,
            "num_cores": self.num_cores,
            "core_cpus": [list(c) for c in self.core_cpus],
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


def parse(spec: Optional[str], cpus: Optional[Sequence[int]] = None) -> Topology:
    """Build a topology from a NEURONMP_TOPOLOGY value (None or empty: from the CPUs)."""
    cpus = tuple(cpus) if cpus is not None else available_cpus()
    spec = (spec or "").strip()
    if not spec:
        return Topology("cpus", 1, len(cpus), map_cpus(len(cpus), cpus))
    key = spec.lower()
    if key in PRESETS:
        chips, per = PRESETS[key]
        return Topology(key, chips, per, map_cpus(chips * per, cpus))
    chips, per = _parse_grid(spec)
    return Topology(f"{chips}x{per}", chips, per, map_cpus(chips * per, cpus))


def _parse_grid(spec: str) -> Tuple[int, int]:
    parts = spec.lower().split("x")
    accepted = sorted(PRESETS)
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise TopologyError(spec, accepted)
    chips, per = (int(p) for p in parts)
    if chips < 1 or per < 1 or chips * per > _MAX_CORES:
        raise TopologyError(spec, accepted)
    return chips, per


def from_env(environ: Optional[Mapping[str, str]] = None) -> Topology:
    """The topology this process sees, from ``NEURONMP_TOPOLOGY``."""
    env = os.environ if environ is None else environ
    return parse(env.get(ENV_TOPOLOGY))
