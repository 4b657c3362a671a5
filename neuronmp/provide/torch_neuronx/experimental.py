"""``torch_neuronx.experimental`` as neuronmp provides it: the placement API's pre-2.25 home."""
from __future__ import annotations

from neuronmp.placement import (  # noqa: F401  (re-exported)
    multicore_context,
    neuron_cores_context,
    set_multicore,
    set_neuron_cores,
)

__all__ = ["set_neuron_cores", "set_multicore", "neuron_cores_context", "multicore_context"]
