"""One torchrun job: every collective called with ranks that disagree -- in size, in
dtype, or in the call's shape (its splits, root or reduce op) -- the last rank being
the odd one; prints, per rank, what each case raised and whether the group still
works after it, in a file of its own.  argv: the group's timeout in seconds, the
directory for the ranks' files."""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

R = dist.ReduceOp
dist.init_process_group("neuron", timeout=timedelta(seconds=float(sys.argv[1])))
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device(f"neuron:{int(os.environ['LOCAL_RANK'])}")
odd = rank == world - 1
N = 8 * world
BIG = 1 << 18     # 1 MiB of fp32: the path that maps the peers' tensors


def ones(k, dtype=torch.float32):
    return torch.ones(k, device=dev, dtype=dtype)


def variants(k=N):
    """(size, dtype) this rank passes in the 'size' and 'dtype' cases."""
    return {"size": (k + world if odd else k, torch.float32),
            "dtype": (k, torch.int32 if odd else torch.float32)}


def cases():
    """name -> {kind: a call}; the odd rank's arguments differ from the others'."""
    out = {}
    for kind, (k, dt) in variants().items():
        out.setdefault("all_reduce", {})[kind] = lambda k=k, dt=dt: dist.all_reduce(ones(k, dt))
        out.setdefault("all_reduce_coalesced", {})[kind] = (
            lambda k=k, dt=dt: dist.all_reduce_coalesced([ones(k, dt)]))
        out.setdefault("reduce", {})[kind] = lambda k=k, dt=dt: dist.reduce(ones(k, dt), dst=0)
        out.setdefault("broadcast", {})[kind] = (
            lambda k=k, dt=dt: dist.broadcast(ones(k, dt), src=0))
        out.setdefault("all_gather", {})[kind] = (
            lambda k=k, dt=dt: dist.all_gather([ones(k, dt) for _ in range(world)],
                                               ones(k, dt)))
        out.setdefault("all_gather_into_tensor", {})[kind] = (
            lambda k=k, dt=dt: dist.all_gather_into_tensor(ones(k * world, dt), ones(k, dt)))
        out.setdefault("reduce_scatter", {})[kind] = (
            lambda k=k, dt=dt: dist.reduce_scatter(ones(k, dt),
                                                   [ones(k, dt) for _ in range(world)]))
        out.setdefault("reduce_scatter_tensor", {})[kind] = (
            lambda k=k, dt=dt: dist.reduce_scatter_tensor(ones(k, dt), ones(k * world, dt)))
        out.setdefault("all_to_all", {})[kind] = (
            lambda k=k, dt=dt: dist.all_to_all([ones(k, dt) for _ in range(world)],
                                               [ones(k, dt) for _ in range(world)]))
        out.setdefault("all_to_all_single", {})[kind] = (
            lambda k=k, dt=dt: dist.all_to_all_single(ones(k, dt), ones(k, dt)))
        out.setdefault("gather", {})[kind] = (
            lambda k=k, dt=dt: dist.gather(ones(k, dt), [ones(k, dt) for _ in range(world)]
                                           if rank == 0 else None, dst=0))
        out.setdefault("scatter", {})[kind] = (
            lambda k=k, dt=dt: dist.scatter(ones(k, dt), [ones(k, dt) for _ in range(world)]
                                            if rank == 0 else None, src=0))
    for kind, (k, dt) in variants(BIG).items():
        out.setdefault("all_reduce_mapped", {})[kind] = (
            lambda k=k, dt=dt: dist.all_reduce(ones(k, dt)))
    # the call's shape: its splits (a list of another length, an output of another
    # size, uneven splits: refused on the odd rank itself), its root or its reduce op
    more = 1 if odd else 0
    shape = {
        "all_reduce": lambda: dist.all_reduce(ones(N), op=R.MAX if odd else R.SUM),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(
            [ones(N)], op=R.MAX if odd else R.SUM),
        "all_reduce_mapped": lambda: dist.all_reduce(ones(BIG), op=R.MAX if odd else R.SUM),
        "reduce": lambda: dist.reduce(ones(N), dst=1 if odd else 0),
        "broadcast": lambda: dist.broadcast(ones(N), src=1 if odd else 0),
        "all_gather": lambda: dist.all_gather([ones(N) for _ in range(world + more)],
                                              ones(N)),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            ones(N * world + more), ones(N)),
        "reduce_scatter": lambda: dist.reduce_scatter(
            ones(N), [ones(N) for _ in range(world + more)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            ones(N), ones(N * world + more)),
        "all_to_all": lambda: dist.all_to_all([ones(N) for _ in range(world)],
                                              [ones(N) for _ in range(world + more)]),
        "all_to_all_single": lambda: dist.all_to_all_single(
            ones(N), ones(N), None,
            [N // world + 1] + [N // world] * (world - 2) + [N // world - 1] if odd else None),
        "gather": lambda: dist.gather(ones(N), [ones(N) for _ in range(world)]
                                      if rank == (1 if odd else 0) else None,
                                      dst=1 if odd else 0),
        "scatter": lambda: dist.scatter(ones(N), [ones(N) for _ in range(world)]
                                        if rank == (1 if odd else 0) else None,
                                        src=1 if odd else 0),
        # one rank in a barrier while the others all_reduce
        "barrier": lambda: dist.all_reduce(ones(N)) if odd else dist.barrier(),
    }
    for name, fn in shape.items():
        out.setdefault(name, {})["shape"] = fn
    return out


facts = {}
for name, kinds in cases().items():
    for kind, call in kinds.items():
        fact = {}
        try:
            call()
            fact["raised"] = None
        except Exception as exc:   # what each rank raised is the test's fact
            fact["raised"] = type(exc).__name__
            fact["usage"] = isinstance(exc, ValueError) and type(exc).__name__.startswith(
                "Collective")
            fact["runtime"] = isinstance(exc, RuntimeError)
            fact["fields"] = {f: getattr(exc, f) for f in getattr(exc, "_fields", ())}
            fact["msg"] = str(exc)
            # the error crosses a process boundary with its fields
            import pickle
            back = pickle.loads(pickle.dumps(exc))
            fact["pickled"] = type(back) is type(exc) and str(back) == str(exc)
        # the group still works after the refusal, on every rank
        t = ones(4)
        dist.all_reduce(t)
        fact["after"] = t.cpu().tolist() == [float(world)] * 4
        facts[f"{name}/{kind}"] = fact

dist.destroy_process_group()
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "facts": facts}, f)
