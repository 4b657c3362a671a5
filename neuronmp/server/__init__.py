"""neuronmp-serve: the KServe v2 / Triton HTTP and gRPC protocols in front of a model
repository.

    errors.py   its errors (a bad repository entry, request or shared-memory region)
    config.py   the repository: Triton's layout and config fields, checked at start
    models.py   a served model: loaded on its cores behind a BatchingServer; tensors
                between the protocol and torch
    shm.py      the system shared-memory extension's regions
    metrics.py  Prometheus metrics with Triton's names
    infer.py    one inference request, whatever protocol carried it: checks,
                schedule parameters, the one request path, outputs, error statuses
    app.py      the HTTP endpoints (aiohttp)
    grpc_service.py  GRPCInferenceService (grpc.aio): messages to and from infer.py
    __main__.py the command: start, ready, drain on SIGTERM, exit

Imported only by its entry point: ``import neuronmp`` never loads it.
"""
