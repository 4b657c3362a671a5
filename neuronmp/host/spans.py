"""The one core-span formatter: how people and the Neuron runtime write sets of cores.

At the bottom of the layers (no imports from neuronmp): errors, visibility, the
launcher and the inventory tools all write core sets through :func:`span`.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["span"]


def span(cores: Sequence[int], prefix: str = "", *, pair: bool = False,
         none: str = "none") -> str:
    """Cores written as people and the runtime write them: '3-5', or 'nc3-nc5'.

    Runs of consecutive ids become 'first-last', joined by commas ('0-2,6');
    ``prefix`` goes before each id; a lone core is '3', or '3-3' with ``pair``
    (the Neuron runtime's refusal says 'Requested:nc1-nc1'); no cores: ``none``.
    """
    runs: List[Tuple[int, int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], core)
        else:
            runs.append((core, core))
    if not runs:
        return none
    return ",".join(f"{prefix}{a}" if a == b and not pair else f"{prefix}{a}-{prefix}{b}"
                    for a, b in runs)
