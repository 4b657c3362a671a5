"""neuronmp-serve: the KServe v2 / Triton HTTP protocol in front of a model repository.

    config.py   the repository: Triton's layout and config fields, checked at start
    models.py   a served model: loaded on its cores behind a BatchingServer; tensors
                between the protocol and torch
    shm.py      the system shared-memory extension's regions
    app.py      the HTTP endpoints (aiohttp)
    metrics.py  Prometheus metrics with Triton's names
    __main__.py the command: start, ready, drain on SIGTERM, exit

Imported only by its entry point: ``import neuronmp`` never loads it.
"""
