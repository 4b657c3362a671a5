"""``neuronmp-serve`` (also ``python -m neuronmp.serve`` and ``python -m neuronmp.server``).

    neuronmp-serve --model-repository DIR [--http-port 8000] [--grpc-port 8001]
                   [--metrics-port 8002] [--host 127.0.0.1] [--unix-socket PATH]

Every endpoint listens on loopback unless ``--host`` says otherwise (see
docs/guides/serving-security.md: the protocols have no authentication).

Life cycle:

    load every model (checked, placed, warmed) ─▶ listen ─▶ ready
    SIGTERM / SIGINT ─▶ not ready; new requests get 503 ─▶ requests in flight finish
    (up to --grace seconds; a second signal ends the wait) ─▶ BatchingServers closed
    ─▶ runtime shut down ─▶ exit 0   (signals from here on are ignored: the shutdown
                                      is bounded, and dying in it would leave files)

A bad repository fails before the server listens (exit 2, the message naming the
file, the field and what is accepted), and before torch and the HTTP stack are
imported: config.py reads every model's config without them, so a typo fails at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:
    from .config import ModelConfig

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _parser() -> argparse.ArgumentParser:
    """neuronmp-serve's options (docs/reference.md lists them; tests/test_docs.py checks)."""
    ap = argparse.ArgumentParser(
        prog="neuronmp-serve",
        description="Serve a Triton-layout model repository of neuronmp traces over the "
                    "KServe v2 HTTP and gRPC protocols.")
    ap.add_argument("--model-repository", required=True, metavar="DIR")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=None,
                    help="GRPCInferenceService (default 8001, when grpcio and "
                         "tritonclient[grpc] are installed); 0: none")
    ap.add_argument("--metrics-port", type=int, default=8002,
                    help="Prometheus /metrics (also served on the HTTP port); 0: none")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address the HTTP, metrics and gRPC endpoints listen on (default "
                         "127.0.0.1: clients on this host only). 0.0.0.0 or :: exposes them "
                         "to the network, and the protocols have no authentication: anyone "
                         "who reaches the ports may run the models and read the metrics "
                         "(shared memory stays refused to clients not on this host)")
    ap.add_argument("--unix-socket", metavar="PATH",
                    help="also serve HTTP/REST on this Unix socket, mode 0600 (this user "
                         "and root); shared memory there only for the server's own user "
                         "(peer credentials)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds requests in flight may take after SIGTERM")
    ap.add_argument("--http-frontend", choices=("auto", "httptools", "aiohttp"),
                    default="auto",
                    help="httptools: the HTTP/1.1 front end on httptools' parser; aiohttp: "
                         "the aiohttp application; auto (default): httptools when installed")
    return ap


def _args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    for name in ("http_port", "metrics_port", "grpc_port"):
        port = getattr(args, name) or 0
        if not 0 <= port <= 65535:
            ap.error(f"--{name.replace('_', '-')} {port}: a port is 0..65535")
    if args.http_port == 0:
        ap.error("--http-port 0: give the port to listen on")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = _args(argv)
    configs = _check_repository(args.model_repository)
    if configs is None:
        return 2
    try:
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        print(f"neuronmp-serve needs {exc.name}: pip install 'neuronmp[serve]'",
              file=sys.stderr)
        return 2
    args.grpc = _grpc_wanted(args)
    args.front = _front_module(args.http_frontend)
    from ..errors import NeuronmpError
    from .models import load_models

    try:
        models = load_models(args.model_repository, configs)
    except NeuronmpError as exc:
        print(f"neuronmp-serve: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args, models))
    except OSError as exc:   # a port taken: the server never got ready
        print(f"neuronmp-serve: cannot listen: {exc}", file=sys.stderr)
        return 2
    finally:
        import neuronmp

        neuronmp.shutdown()


def _check_repository(root: str) -> Optional[List[ModelConfig]]:
    """Every model's config of ``root``, checked; None after printing the error.

    Runs before torch and the HTTP stack are imported (config.py and host/settings.py
    need neither): a mistyped path or a malformed config fails at once, not after
    those imports."""
    from ..errors import NeuronmpError
    from ..host import settings
    from .config import load_repository

    try:
        # a malformed NEURONMP_SHM_MAX_REGIONS fails before loading (shm.max_regions
        # reads the same setting, but shm.py imports numpy)
        settings.get("shm_max_regions")
        return load_repository(root)
    except NeuronmpError as exc:
        print(f"neuronmp-serve: {exc}", file=sys.stderr)
        return None


async def _serve(args: argparse.Namespace, models: Dict[str, object]) -> int:
    from aiohttp import web

    from .app import make_app
    from .app import runner as app_runner
    from .infer import State
    from .metrics import Metrics
    from .routes import METRICS

    metrics = Metrics()
    metrics.models = models
    state = State(models, metrics)
    front = args.front
    runners = [] if front else [app_runner(make_app(state))]
    if args.metrics_port:
        runners.append(app_runner(make_app(state, METRICS)))
    ports = ([] if front else [args.http_port]) + [args.metrics_port]
    for runner, port in zip(runners, ports):
        await runner.setup()
        await web.TCPSite(runner, args.host, port).start()
    if front:
        http = await _listen_unix(args.unix_socket, lambda path: front.start(
            state, args.host, args.http_port, path))
    elif args.unix_socket:
        await _listen_unix(args.unix_socket, lambda path: web.UnixSite(runners[0], path).start())
    grpc_server = await _start_grpc(args, state)
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        # the first signal starts the drain, a second one cuts its grace short
        loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    # What start-up made (torch, the models, aiohttp) lives as long as the server:
    # out of the collector's sight, a full collection scans only what requests made
    # since, rather than stalling the event loop for every request waiting on it
    # (docs/guides/event-loop-serving.md)
    gc.collect()
    gc.freeze()
    state.ready = True
    print(f"neuronmp-serve: ready on {args.host} port {args.http_port} (metrics on "
          f"{args.metrics_port or args.http_port}"
          f"{f', gRPC on {args.grpc_port}' if grpc_server else ''}"
          f"{f', HTTP also on {args.unix_socket}' if args.unix_socket else ''}); models: "
          + ", ".join(f"{n} on cores {list(m.cores)}" for n, m in models.items()), flush=True)
    await stop.wait()
    await _drain(state, args.grace, hurry)
    _stay_alive_through_shutdown(loop)
    if grpc_server is not None:
        await grpc_server.stop(None)
    if front:
        await http.close()
    for runner in runners:
        await runner.cleanup()
    if args.unix_socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.unix_socket)
    for m in models.values():
        m.close()
    print("neuronmp-serve: stopped", flush=True)
    return 0


def _front_module(choice: str):
    """The HTTP/1.1 front end of server/front.py (``--http-frontend``: auto when
    httptools is installed), else None: the aiohttp application serves HTTP."""
    if choice == "aiohttp":
        return None
    try:
        from . import front
    except ImportError as exc:
        if choice == "httptools":
            print(f"neuronmp-serve: --http-frontend httptools needs {exc.name}: pip "
                  "install 'neuronmp[serve]'", file=sys.stderr)
            raise SystemExit(2) from None
        return None
    return front


async def _listen_unix(path: Optional[str], listen):
    """``listen(path)``; a Unix socket ``path`` that only this user (and root) can
    connect to."""
    if not path:
        return await listen(None)
    if os.path.lexists(path):   # never unlink what may be another server's socket
        raise OSError(f"--unix-socket {path} exists: remove it, or choose another path")
    old = os.umask(0o177)   # created 0600: no moment when others could connect
    try:
        return await listen(path)
    finally:
        os.umask(old)


def _grpc_wanted(args: argparse.Namespace) -> bool:
    """Whether to serve gRPC: not with --grpc-port 0; without its packages, an error
    when --grpc-port was given, else a note on stderr (HTTP only)."""
    if args.grpc_port == 0:
        return False
    try:
        from . import grpc_service  # noqa: F401
    except ImportError as exc:
        if args.grpc_port is not None:
            print(f"neuronmp-serve: --grpc-port needs {exc.name}: pip install "
                  "'neuronmp[grpc]'", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"neuronmp-serve: no gRPC endpoint ({exc.name} is not installed: pip "
              "install 'neuronmp[grpc]')", file=sys.stderr, flush=True)
        return False
    args.grpc_port = args.grpc_port or 8001
    return True


async def _start_grpc(args: argparse.Namespace, state):
    if not args.grpc:
        return None
    from . import grpc_service

    return await grpc_service.start(state, args.host, args.grpc_port)


async def _drain(state, grace: float, hurry: asyncio.Event) -> None:
    """Not ready and no new requests; those in flight get up to ``grace`` seconds
    (a second SIGTERM/SIGINT ends the wait: they then fail with an error)."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while state.in_flight and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.01)


def _stay_alive_through_shutdown(loop: asyncio.AbstractEventLoop) -> None:
    """From here on a stop signal changes nothing: the shutdown that follows is bounded
    (the pool's staged stop), and dying halfway would leave segments and records.
    asyncio resets the signals it handled to SIG_DFL when its loop closes, so a signal
    that came between the loop's end and the runtime's shutdown killed the server
    mid-cleanup (a supervisor's second SIGTERM did, in CI); Python-level handlers
    installed here outlive the loop."""
    for sig in _STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, _already_stopping)


def _already_stopping(signum, frame) -> None:
    print(f"neuronmp-serve: {signal.Signals(signum).name} ignored: already stopping",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
