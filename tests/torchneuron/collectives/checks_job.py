"""One torchrun job: the calls TorchNeuron's process group refuses, each made on
every rank alike; per case, what each rank raised (class, builtins it refines, message)
and whether the group works after it, in a file per rank.  Also the results of the
calls it accepts where it once refused: integer AVG, coalesced lists with empty
tensors.  argv: the directory for the ranks' files."""
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist

R = dist.ReduceOp
dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device(f"neuron:{int(os.environ['LOCAL_RANK'])}")


def on(*shape, dtype=torch.float32):
    return torch.ones(*shape, device=dev, dtype=dtype)


CASES = {
    "all_reduce/cpu": lambda: dist.all_reduce(torch.ones(4)),
    "broadcast/cpu": lambda: dist.broadcast(torch.ones(4), src=0),
    "reduce_scatter/one_cpu": lambda: dist.reduce_scatter(
        on(4), [on(4)] + [torch.ones(4) for _ in range(world - 1)]),
    "all_to_all/cpu": lambda: dist.all_to_all([torch.ones(3) for _ in range(world)],
                                              [torch.ones(3) for _ in range(world)]),
    "reduce/root": lambda: dist.reduce(on(4), dst=world + 1),
    "broadcast/root": lambda: dist.broadcast(on(4), src=999),
    # no rank is the root: torch lets none pass a list
    "gather/root": lambda: dist.gather(on(4), None, dst=world + 1),
    "scatter/root": lambda: dist.scatter(on(4), None, src=world + 1),
    "reduce_scatter/identical": lambda: dist.reduce_scatter(on(4, 4), [on(4, 4)]),
    "reduce_scatter/uneven": lambda: dist.reduce_scatter(on(3), [on(8)]),
    "reduce_scatter/product": lambda: dist.reduce_scatter(
        on(4), [on(4) for _ in range(world)], op=dist.ReduceOp.PRODUCT),
    "reduce_scatter_tensor/bxor": lambda: dist.reduce_scatter_tensor(
        on(4, dtype=torch.int32), on(4 * world, dtype=torch.int32), op=dist.ReduceOp.BXOR),
    "reduce_scatter_tensor/input": lambda: dist.reduce_scatter_tensor(on(10), on(21)),
    "reduce_scatter_tensor/output": lambda: dist.reduce_scatter_tensor(on(5), on(20)),
    "reduce_scatter_tensor_coalesced/rows": lambda: dist.group.WORLD.
    reduce_scatter_tensor_coalesced([on(2, 3), on(4, 5)], [on(4, 3), on(8, 5)]),
    "all_reduce/empty": lambda: dist.all_reduce(on(0)),
    "reduce/empty": lambda: dist.reduce(on(0), dst=0),
    "all_gather/empty": lambda: dist.all_gather([on(0) for _ in range(world)], on(0)),
    "gather/empty": lambda: dist.gather(on(0), [on(0) for _ in range(world)]
                                        if rank == 0 else None, dst=0),
    "all_gather_into_tensor/size": lambda: dist.all_gather_into_tensor(on(5 * world + 1),
                                                                       on(5)),
    "all_to_all/list": lambda: dist.all_to_all([on(3) for _ in range(world)],
                                               [on(3) for _ in range(world - 1)]),
    "all_to_all/shape": lambda: dist.all_to_all([on(3) for _ in range(world)],
                                                [on(5)] + [on(3) for _ in range(world - 1)]),
    # the second input's first output one element long
    "all_gather_coalesced/shape": lambda: dist.all_gather_coalesced(
        [[on(3) for _ in range(world)], [on(4)] + [on(3) for _ in range(world - 1)]],
        [on(3), on(3)]),
    "all_to_all_single/uneven": lambda: dist.all_to_all_single(
        on(2 * world), on(2 * world), None, [3] + [2] * (world - 2) + [1]),
    # equal parts of more than a row are refused too; ones must cover dim 0
    "all_to_all_single/equal": lambda: dist.all_to_all_single(
        on(2 * world), on(2 * world), None, [2] * world),
    "all_to_all_single/ones": lambda: dist.all_to_all_single(
        on(2 * world), on(2 * world), None, [1] * world),
}

facts = {}
for case, call in CASES.items():
    fact = {"raised": None}
    try:
        call()
    except Exception as exc:   # what each rank raised is the test's fact
        back = pickle.loads(pickle.dumps(exc))
        fact = {"raised": type(exc).__name__, "msg": str(exc),
                "runtime": isinstance(exc, RuntimeError), "value": isinstance(exc, ValueError),
                "pickled": type(back) is type(exc) and str(back) == str(exc)}
    t = on(4)
    dist.all_reduce(t)
    fact["after"] = t.cpu().tolist() == [float(world)] * 4
    facts[case] = fact

# integer AVG: the sum divided in the tensor's dtype, toward zero (-3 / 2 is -1)
avg = torch.tensor([rank + 1, -(rank + 1)], dtype=torch.int32, device=dev)
dist.all_reduce(avg, op=R.AVG)
avg_rs = torch.empty(1, dtype=torch.int64, device=dev)
dist.reduce_scatter_tensor(avg_rs, torch.full((world,), rank + 1, dtype=torch.int64,
                                              device=dev), op=R.AVG)
# the coalesced forms leave empty tensors out and reduce or gather the rest
mixed = [on(2) * (rank + 1), on(0), on(3)]
dist.all_reduce_coalesced(mixed)
outs = [torch.zeros(world * 2, device=dev), torch.zeros(0, device=dev)]
dist.group.WORLD.allgather_into_tensor_coalesced(outs, [on(2) * (rank + 1), on(0)])
# reduce_scatter's one tensor of another rank than the output: leading 1s pad the shorter
shorter = torch.zeros(2, device=dev)
dist.reduce_scatter(shorter, [torch.arange(4.0, device=dev).reshape(2, 2) + rank])
deeper = torch.zeros(1, 2, 3, device=dev)
dist.reduce_scatter(deeper, [torch.arange(12.0, device=dev).reshape(4, 3) + rank])
# torch's object collectives put their bytes on the device the group names: neuron
objects = [None, None]
dist.all_gather_object(objects, {"rank": rank})
results = {"objects": objects, "shorter": shorter.cpu().tolist(), "deeper": deeper.cpu().tolist(),
           "avg": avg.cpu().tolist(), "avg_rs": avg_rs.cpu().tolist(),
           "coalesced": [m.cpu().tolist() for m in mixed],
           "gathered": [o.cpu().tolist() for o in outs]}

dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "facts": facts, "results": results}, f)
