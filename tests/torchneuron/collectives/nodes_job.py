"""A rank of a job spanning two neuronmp-run launchers: the neuron group falls back to
gloo across the "hosts" and keeps the API; prints JSON facts."""
import json

import torch
import torch.distributed as dist

dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), float(rank + 1), device="neuron")
dist.all_reduce(t)
g = torch.empty(world, device="neuron")
dist.all_gather_into_tensor(g, torch.tensor([float(rank)], device="neuron"))
pg = dist.distributed_c10d._get_default_group()
print(json.dumps({"rank": rank, "transport": pg.transport, "sum": t.cpu().tolist(),
                  "gathered": g.cpu().tolist(), "device": str(t.device)}), flush=True)
dist.destroy_process_group()
