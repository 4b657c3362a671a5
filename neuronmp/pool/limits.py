"""The pool's settings: the ``NEURONMP_*`` and ``NEURON_RT_*`` variables the
coordinator reads, once, when it is first imported (the first model load), so a
bad value fails in the caller, naming it, and not in every worker.

The other pool modules read these as ``limits.NAME`` at the moment they use them
(never copied at import), so a test or tool may set one for a pool it starts.
"""
from __future__ import annotations

from .. import envconfig

READY_TIMEOUT = envconfig.seconds("NEURONMP_WORKER_START_TIMEOUT", 120.0, low=0.001)
RING_BYTES = envconfig.size("NEURONMP_RING_BYTES", 8 << 20, 64 << 10, 1 << 40)
# a caller's spin budget: how long a caller waiting for a short answer keeps its CPU
WAIT_SPIN = envconfig.microseconds("NEURONMP_WAIT_SPIN_US", 2000.0) * 1e-6
# an idle worker's spin budget: how long it stays awake for the next request
WORKER_SPIN = envconfig.microseconds("NEURONMP_WORKER_SPIN_US", 200.0) * 1e-6
# the Neuron runtime's bound on one execution (seconds; 0: none)
EXEC_TIMEOUT = envconfig.seconds("NEURON_RT_EXEC_TIMEOUT", 30.0)
# see worker._keep_freed_memory; 0 keeps glibc's defaults
KEEP_MB = envconfig.integer("NEURONMP_WORKER_KEEP_MB", 1024, 0, 1 << 20,
                            accepted="the megabytes a worker keeps for reuse, 0 to keep "
                                     "glibc's defaults")
# 1: the cores of a model map one read-only copy of its weights (pool/weights.py);
# 0: each core loads its own, writable copy (models that keep state in buffers)
SHARE_WEIGHTS = envconfig.integer(
    "NEURONMP_SHARE_WEIGHTS", 1, 0, 1,
    accepted="1 to map one read-only copy of a model's weights into all its cores, 0 to "
             "give each core its own copy")

STOP_GRACE = 5.0  # seconds a stopping worker is given before SIGKILL
START_TRIES = 3  # starts of a replacement worker before its core is given up
SPIN_LONGEST = 1e-3  # requests that usually take longer than this are waited for asleep
