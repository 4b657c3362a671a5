"""Dynamic batching: a request server over a traced model's cores.

    server.py    BatchingServer: the public face, the checks, stats, life cycle
    config.py    the arguments' checks, QueuePolicy, Rules
    queue.py     BatchQueue (one path's waiting requests, its lock, the rules) and
                 CoreSlots (the cores' batch slots every path shares)
    threads.py   the threads' path (infer, submit): batches formed by the callers
                 and by the threads that read the answers; the clock
    loop.py      an event loop's path (infer_async): batches formed on the loop
    rows.py      a batch's rows stacked and padded, its outputs split per caller
    rowbytes.py  requests given as bytes (the HTTP front end's)

Both paths hand a formed batch to its core through one call, ``model.Route.send``.
"""
from __future__ import annotations

from ..errors import QueueFullError, RequestTimeoutError, ServerClosedError
from .config import QueuePolicy
from .server import BatchingServer

__all__ = ["BatchingServer", "QueuePolicy", "QueueFullError", "RequestTimeoutError",
           "ServerClosedError"]
