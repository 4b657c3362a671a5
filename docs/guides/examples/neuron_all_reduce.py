import os

import torch
import torch.distributed as dist
import torch_neuronx  # noqa: F401  (registers the neuron device and distributed backend)

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group(backend="neuron", init_method="env://", rank=rank,
                        world_size=world_size)
process_group = dist.group.WORLD

value = torch.tensor([float(rank + 1)], device=torch.device("neuron"))
dist.all_reduce(value, op=dist.ReduceOp.SUM, group=process_group)
print(f"rank {rank} (LOCAL_RANK {os.environ['LOCAL_RANK']}, {value.device}): "
      f"sum = {value.cpu().item()}", flush=True)
dist.destroy_process_group()
