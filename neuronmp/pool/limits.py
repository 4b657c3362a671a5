"""The pool's settings: the ``NEURONMP_*`` and ``NEURON_RT_*`` variables the pool
obeys, by the names the pool's modules use, and its fixed bounds.

The variables are parsed by the one settings object (neuronmp/settings.py), once per
runtime: ``limits.RING_BYTES`` is read at the moment it is used and answers with the
running runtime's value (a bad value failed ``runtime.init`` already, naming it).
Nothing here is copied at import, so a process that starts a second runtime with
other variables gets the second runtime's values.
"""
from __future__ import annotations

from typing import Any

from .. import settings

#: the pool's name -> the settings field it reads
_FIELDS = {
    "READY_TIMEOUT": "worker_start_timeout",   # NEURONMP_WORKER_START_TIMEOUT, seconds
    "RING_BYTES": "ring_bytes",                # NEURONMP_RING_BYTES
    # a caller's spin budget: how long a caller waiting for a short answer keeps its CPU
    "WAIT_SPIN": "wait_spin",                  # NEURONMP_WAIT_SPIN_US, in seconds
    # an idle worker's spin budget: how long it stays awake for the next request
    "WORKER_SPIN": "worker_spin",              # NEURONMP_WORKER_SPIN_US, in seconds
    # the Neuron runtime's bound on one execution (seconds; 0: none)
    "EXEC_TIMEOUT": "exec_timeout",            # NEURON_RT_EXEC_TIMEOUT
    # see worker._keep_freed_memory; 0 keeps glibc's defaults
    "KEEP_MB": "worker_keep_mb",               # NEURONMP_WORKER_KEEP_MB
    # the cores of a model map one read-only copy of its weights (pool/weights.py), or
    # each core loads its own, writable copy (models that keep state in buffers)
    "SHARE_WEIGHTS": "share_weights",          # NEURONMP_SHARE_WEIGHTS
}

STOP_GRACE = 5.0  # seconds a stopping worker is given before SIGKILL
START_TRIES = 3  # starts of a replacement worker before its core is given up
SPIN_LONGEST = 1e-3  # requests that usually take longer than this are waited for asleep


def __getattr__(name: str) -> Any:
    field = _FIELDS.get(name)
    if field is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return settings.get(field)


def __dir__():
    return sorted(list(globals()) + list(_FIELDS))
