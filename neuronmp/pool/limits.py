"""The pool's settings: the ``NEURONMP_*`` and ``NEURON_RT_*`` variables the pool
obeys, as functions named for what the pool's modules use them for, and its fixed bounds.

The variables are parsed by the one settings object (neuronmp/host/settings.py), once per
runtime: ``limits.ring_bytes()`` reads it at the moment it is called and answers with
the running runtime's value (a bad value failed ``runtime.init`` already, naming it).
Nothing here is copied at import, so a process that starts a second runtime with
other variables gets the second runtime's values.
"""
from __future__ import annotations

from ..host import settings

STOP_GRACE = 5.0  # seconds a stopping worker is given before SIGKILL
START_TRIES = 3  # starts of a replacement worker before its core is given up
SPIN_LONGEST = 1e-3  # requests that usually take longer than this are waited for asleep


def ready_timeout() -> float:
    """Seconds a starting worker has to say it is ready (NEURONMP_WORKER_START_TIMEOUT)."""
    return settings.get("worker_start_timeout")


def ring_bytes() -> int:
    """The size of each request and response ring (NEURONMP_RING_BYTES)."""
    return settings.get("ring_bytes")


def wait_spin() -> float:
    """Seconds a caller waiting for a short answer keeps its CPU (NEURONMP_WAIT_SPIN_US)."""
    return settings.get("wait_spin")


def worker_spin() -> float:
    """Seconds an idle worker stays awake for the next request (NEURONMP_WORKER_SPIN_US)."""
    return settings.get("worker_spin")


def exec_timeout() -> float:
    """The Neuron runtime's bound on one execution, seconds; 0: none (NEURON_RT_EXEC_TIMEOUT)."""
    return settings.get("exec_timeout")


def keep_mb() -> int:
    """Freed memory a worker keeps, see worker._keep_freed_memory; 0: glibc's defaults
    (NEURONMP_WORKER_KEEP_MB)."""
    return settings.get("worker_keep_mb")


def share_weights() -> bool:
    """Whether the cores of a model map one read-only copy of its weights (pool/weights.py)
    rather than each loading its own, writable copy, for models that keep state in
    buffers (NEURONMP_SHARE_WEIGHTS)."""
    return settings.get("share_weights")
