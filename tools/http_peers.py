"""The serving peers of tools/bench_http.py: the same MLP behind LitServe, mosec and Ray
Serve, each with its own dynamic batching.  Started by bench_http.py, one at a time:

    python tools/http_peers.py litserve|mosec|ray --port P --weights FILE
        [--workers 2] [--max-batch 32] [--delay-ms 2] [--api-servers 1]

Each peer computes with the plain torch module of bench_dp (the weights neuronmp's
trace was made from), one torch thread per worker process, on the rows it batched
(no padding).  Wire formats, each the peer's own:

    litserve   JSON  {"input": [512 floats]} -> {"output": [10 floats]}
    mosec      raw fp32 bytes in and out (Worker.deserialize / serialize overridden)
    ray        raw fp32 bytes in and out (the starlette Request's body)

A peer that is not installed exits 3 with a message.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FEATURES = 512


def _load_mlp(weights: str):
    import torch
    from bench_dp import mlp

    torch.set_num_threads(1)
    net = mlp()
    net.load_state_dict(torch.load(weights))
    return net.eval()


def _forward(net, rows: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return net(torch.from_numpy(rows)).numpy()


# -- LitServe ---------------------------------------------------------------------------

try:
    import litserve as _ls
except ImportError:
    _ls = None

if _ls is not None:
    class MlpLitAPI(_ls.LitAPI):
        def __init__(self, weights: str, **kw):
            super().__init__(**kw)
            self.weights = weights

        def setup(self, device):
            self.net = _load_mlp(self.weights)

        def decode_request(self, request):
            return np.asarray(request["input"], dtype=np.float32)

        def batch(self, inputs):
            return np.stack(inputs)

        def predict(self, x):
            return _forward(self.net, x)

        def unbatch(self, output):
            return list(output)

        def encode_response(self, output):
            return {"output": output.tolist()}


def run_litserve(a: argparse.Namespace) -> None:
    if _ls is None:
        sys.exit("litserve is not installed: pip install 'neuronmp[bench]'")
    api = MlpLitAPI(a.weights, max_batch_size=a.max_batch, batch_timeout=a.delay_ms / 1000)
    server = _ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=a.workers,
                           timeout=30)
    server.run(host="127.0.0.1", port=a.port, num_api_servers=a.api_servers,
               log_level="warning", generate_client_file=False)


# -- mosec ------------------------------------------------------------------------------

try:
    import mosec as _mosec
except ImportError:
    _mosec = None

if _mosec is not None:
    class MlpMosecWorker(_mosec.Worker):
        def __init__(self):
            super().__init__()
            self.net = _load_mlp(os.environ["BENCH_HTTP_WEIGHTS"])

        def deserialize(self, data: bytes):
            return np.frombuffer(data, dtype=np.float32)

        def serialize(self, data) -> bytes:
            return data.tobytes()

        def forward(self, data):
            return list(_forward(self.net, np.stack(data)))


def run_mosec(a: argparse.Namespace) -> None:
    if _mosec is None:
        sys.exit("mosec is not installed: pip install 'neuronmp[bench]'")
    os.environ["BENCH_HTTP_WEIGHTS"] = a.weights
    # mosec reads its own options (port, address) from the command line
    sys.argv = [sys.argv[0], "--port", str(a.port), "--address", "127.0.0.1",
                "--log-level", "warning", "--timeout", "30000"]
    server = _mosec.Server()
    server.append_worker(MlpMosecWorker, num=a.workers, max_batch_size=a.max_batch,
                         max_wait_time=max(1, round(a.delay_ms)))
    server.run()


# -- Ray Serve --------------------------------------------------------------------------

def run_ray(a: argparse.Namespace) -> None:
    try:
        import ray
        from ray import serve
    except ImportError:
        sys.exit("ray[serve] is not installed")
    import signal
    import threading

    weights, max_batch, wait = a.weights, a.max_batch, a.delay_ms / 1000

    @serve.deployment(num_replicas=a.workers, ray_actor_options={"num_cpus": 0.5},
                      max_ongoing_requests=256)
    class MlpRay:
        def __init__(self):
            self.net = _load_mlp(weights)

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=wait)
        async def infer(self, rows):
            return list(_forward(self.net, np.stack(rows)))

        async def __call__(self, request):
            body = await request.body()
            out = await self.infer(np.frombuffer(body, dtype=np.float32))
            from starlette.responses import Response
            return Response(out.tobytes(), media_type="application/octet-stream")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=a.temp_dir)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(MlpRay.bind(), route_prefix="/", name="mlp")
    print("ray serve ready", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    serve.shutdown()
    ray.shutdown()


PEERS = {"litserve": run_litserve, "mosec": run_mosec, "ray": run_ray}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peer", choices=sorted(PEERS))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--weights", required=True, help="the MLP's state_dict (torch.save)")
    p.add_argument("--workers", type=int, default=2, help="model worker processes")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=2.0, help="longest wait for a batch")
    p.add_argument("--api-servers", type=int, default=None,
                   help="LitServe's HTTP processes (default: LitServe's, one per worker)")
    p.add_argument("--temp-dir", help="Ray's session directory (removed by the caller)")
    a = p.parse_args(argv)
    PEERS[a.peer](a)


if __name__ == "__main__":
    main()
