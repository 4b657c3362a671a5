"""Messages between the coordinator and a core's worker (over the two rings).

    request ring  (coordinator -> worker):  (op, request id, model id, payload)
    response ring (worker -> coordinator):  (request id, ok, payload)

``payload`` of RUN is the argument tuple and of LOAD the TorchScript bytes (as
a uint8 tensor, so they travel as raw bytes, not pickled).  A failed request
answers ``ok=False`` with ``(exception type, message, traceback text)``.
INFO answers a dict describing the worker (pid, core, CPUs, torch threads,
loaded models).  Request id 0 is the worker's READY greeting, -1 its goodbye after STOP.
"""
RUN, LOAD, UNLOAD, STOP, INFO = 1, 2, 3, 4, 5
READY_ID, BYE_ID = 0, -1
