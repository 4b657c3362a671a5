"""One rank of a job started by hand, as TorchNeuron's own test harness starts its ranks
(its environment, no launcher): the rank rules, subgroups made after the model is on the
device, reduce_scatter's one-tensor-list form and SyncBatchNorm; prints JSON facts."""
import json
import os

import torch
import torch.distributed as dist

visible_before = os.environ.get("NEURON_RT_VISIBLE_CORES")
dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
facts = {"rank": rank, "visible_before": visible_before,
         "visible_after": os.environ.get("NEURON_RT_VISIBLE_CORES"),
         "device_count": torch.neuron.device_count(),
         "current": torch.neuron.current_device()}

import neuronmp.host.runtime  # noqa: E402  (after init: the runtime the group started)

x = torch.full((4,), float(rank + 1), device="neuron")
facts["device"] = str(x.device)
facts["cores"] = list(neuronmp.host.runtime.get_runtime().cores)


def refused(index):
    try:
        torch.ones(1, device=f"neuron:{index}")
    except Exception as exc:  # noqa: BLE001  (the message is the fact)
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


# any index of this host's devices has properties (TorchNeuron checks the range only)
facts["props"] = [torch.neuron.get_device_properties(i).name for i in range(world)]
facts["refused"] = {str(i): refused(i) for i in range(world + 1) if i != rank}

# subgroups once neuron tensors exist: the whole world again, each rank alone, a mesh
sub = dist.new_group(list(range(world)))
y = x.clone()
dist.all_reduce(y, group=sub)
alone = [dist.new_group([r]) for r in range(world)][rank]
z = x.clone()
dist.all_reduce(z, group=alone)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

mesh = init_device_mesh("neuron", (world,))
m = x.clone()
dist.all_reduce(m, group=mesh.get_group())
# a group's Works are numbered in call order
works = [dist.all_reduce(x.clone(), async_op=True) for _ in range(3)]
facts["seq"] = [w.get_sequence_number() for w in works]
facts["subgroups"] = [y.cpu().tolist(), z.cpu().tolist(), m.cpu().tolist()]

# reduce_scatter with one tensor holding every rank's part (scatter along the dim that is
# world times the output's): 1-D, and a 3-D input split along its middle dim
flat = torch.arange(2 * world, dtype=torch.float32, device="neuron") + 10 * rank
out = torch.zeros(2, device="neuron")
dist.reduce_scatter(out, [flat])
cube = (torch.arange(2 * 2 * world * 3, dtype=torch.float32).reshape(2, 2 * world, 3)
        + 100 * rank).to("neuron")
part = torch.zeros(2, 2, 3, device="neuron")
dist.reduce_scatter(part, [cube], op=dist.ReduceOp.MAX)
facts["reduce_scatter"] = [out.cpu().tolist(), part.cpu().tolist()]

# SyncBatchNorm on the device against BatchNorm over the whole batch on the CPU
def batch(r):
    return torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(7 + r))


torch.manual_seed(0)
bn = torch.nn.SyncBatchNorm(4).to("neuron")
inp = batch(rank).to("neuron").requires_grad_()
out = bn(inp)
(out * out).sum().backward()
ref_bn = torch.nn.BatchNorm1d(4)
whole = torch.cat([batch(r) for r in range(world)]).requires_grad_()
ref = ref_bn(whole)
(ref * ref).sum().backward()
dist.all_reduce(bn.weight.grad)   # each rank's is its part's: the job's is their sum
mine = slice(3 * rank, 3 * rank + 3)
close = lambda a, b: bool(torch.allclose(a.detach().cpu(), b.detach(), atol=1e-5))  # noqa: E731
facts["syncbn"] = {
    "out": close(out, ref[mine]),
    # each rank's loss is its own part: the whole batch's gradient per part
    "grad_input": close(inp.grad, whole.grad[mine]),
    "grad_weight": close(bn.weight.grad, ref_bn.weight.grad),
    "running_mean": close(bn.running_mean, ref_bn.running_mean),
    "running_var": close(bn.running_var, ref_bn.running_var),
}
dist.destroy_process_group()
print(json.dumps(facts), flush=True)
