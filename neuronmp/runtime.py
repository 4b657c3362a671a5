"""The per-process runtime: this process's cores (placeholder until reservations land)."""
from __future__ import annotations

from typing import Tuple

from . import topology as _topology
from . import visibility as _visibility


def visible_cores() -> Tuple[int, ...]:
    topo = _topology.from_env()
    request = _visibility.request_from_env(topo)
    return _visibility.candidate_blocks(request, topo.num_cores)[0]
