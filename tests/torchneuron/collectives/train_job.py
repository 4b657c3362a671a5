"""DDP and FSDP2 (fully_shard) on the neuron group against the same job on gloo and CPU
tensors, in the same ranks; prints JSON facts."""
import copy
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("neuron")
rank = dist.get_rank()
gloo = dist.new_group(backend="gloo")
dev = torch.device(f"neuron:{os.environ['LOCAL_RANK']}")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batches():
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(4)]


def train(m, device, wrap):
    m = wrap(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(m(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m


start = model()
ddp_n = train(copy.deepcopy(start).to(dev), dev, lambda m: DDP(m))
ddp_g = train(copy.deepcopy(start), "cpu", lambda m: DDP(m, process_group=gloo))
pn = [p.detach().cpu() for p in ddp_n.module.parameters()]
pg = [p.detach() for p in ddp_g.module.parameters()]


def fsdp(m, device, group):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(group, device_type=device)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


fs_n = train(copy.deepcopy(start).to(dev), dev,
             lambda m: fsdp(m, "neuron", dist.group.WORLD))
fs_g = train(copy.deepcopy(start), "cpu", lambda m: fsdp(m, "cpu", gloo))
fn = [p.full_tensor().cpu() for p in fs_n.parameters()]
fg = [p.full_tensor() for p in fs_g.parameters()]
print(json.dumps({
    "rank": rank,
    "ddp_equal": all(torch.equal(a, b) for a, b in zip(pn, pg)),
    "fsdp_equal": all(torch.equal(a, b) for a, b in zip(fn, fg)),
    "ddp_moved": not all(torch.equal(a, b) for a, b in zip(pn, start.parameters())),
}), flush=True)
dist.barrier(group=gloo)   # no rank tears gloo down while a peer still uses it
dist.destroy_process_group()
