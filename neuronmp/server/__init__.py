"""neuronmp-serve: the KServe v2 / Triton HTTP and gRPC protocols in front of a model
repository.

    errors.py   its errors (a bad repository entry, request or shared-memory region)
    config.py   the repository: Triton's layout and config fields, checked at start
    models.py   a served model: loaded on its cores behind a BatchingServer; tensors
                between the protocol and torch
    shm.py      the system shared-memory extension's regions
    document.py the request document's form checked, and tensors' JSON form both ways
    metrics.py  Prometheus metrics with Triton's names
    infer.py    one inference request, whatever protocol carried it: checks,
                schedule parameters, the one request path, outputs, error statuses
    routes.py   the HTTP routes, defined once: the route table, its handlers, and the
                neutral request and response every HTTP front end adapts to
    wire.py     the HTTP request head's limits; the httptools front end's requests
                and response heads
    front.py    the HTTP/1.1 front end (httptools and the C scanner of _front.c,
                with the fast infer path): an adapter to routes.py
    app.py      the aiohttp front end (the metrics port; HTTP without httptools):
                an adapter to routes.py
    grpc_service.py  GRPCInferenceService (grpc.aio): messages to and from infer.py
    __main__.py the command: start, ready, drain on SIGTERM, exit

Imported only by its entry point: ``import neuronmp`` never loads it.
"""
