"""Messages between the coordinator and a core's worker (over the two rings).

    request ring  (coordinator -> worker):  (op, request id, model id, payload, sent)
    response ring (worker -> coordinator):  (request id, ok, payload, due)

``payload`` of RUN is the argument tuple and of LOAD the TorchScript bytes (as
a uint8 tensor, so they travel as raw bytes, not pickled).  A failed request
answers ``ok=False`` with ``(exception type, message, traceback text)``.
INFO answers a dict describing the worker (pid, core, CPUs, torch threads,
loaded models).  ``sent`` is when the coordinator sent the request and ``due``
when its caller may have the answer (0: at once), both ``time.perf_counter_ns()``
(the monotonic clock, the same in every process): a device-time core answers as
soon as it has computed, with the moment its modelled time ends.  Request id 0
is the worker's READY greeting (``ok=False`` with its PACKAGE_DIR when that is not
the coordinator's, which the worker is given at start), -1 its goodbye after STOP.
"""
import os

RUN, LOAD, UNLOAD, STOP, INFO = 1, 2, 3, 4, 5
READY_ID, BYE_ID = 0, -1
# where this copy of neuronmp lives: coordinator and worker must run the same one
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
