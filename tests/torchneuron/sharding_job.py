"""One rank of a two-rank job: ``linear`` on DTensors of the ``neuron`` device with
input and weight laid out four ways, forward and backward, against the same op on
whole CPU tensors; prints JSON facts (placements, gradients' agreement, collectives
in the backward, the rule DTensor used, the device ops that ran)."""
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_neuronx  # noqa: F401  (the stand-in registers the device and the rule)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from neuronmp.torchneuron import optrack, sharding

dist.init_process_group("neuron")
rank = dist.get_rank()
mesh = init_device_mesh("neuron", (dist.get_world_size(),))
propagator = DTensor._op_dispatcher.sharding_propagator
rule = propagator.op_strategy_funcs.get(torch.ops.aten.linear_backward.default)
facts = {"rank": rank, "rule_is_ours": rule is sharding.linear_backward_strategy,
         "cases": {}}

gen = torch.Generator().manual_seed(7)   # every rank the same whole tensors
# (input placement, weight placement, bias placement)
LAYOUTS = {
    "in_features": (Shard(1), Shard(1), Shard(0)),
    "out_features": (Replicate(), Shard(0), Shard(0)),
    "batch": (Shard(0), Replicate(), Replicate()),
    "replicated": (Replicate(), Replicate(), Replicate()),
}
for name, (p_in, p_w, p_b) in LAYOUTS.items():
    x = torch.rand(4, 6, generator=gen)
    w = torch.rand(8, 6, generator=gen)
    b = torch.rand(8, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = F.linear(*leaves)
    out.sum().backward()
    dx, dw, db = (distribute_tensor(t.to("neuron"), mesh, [p]).detach().requires_grad_()
                  for t, p in zip((x, w, b), (p_in, p_w, p_b)))
    dout = F.linear(dx, dw, db)
    optrack.clear_op_tracking()
    comms = CommDebugMode()
    with comms:
        dout.sum().backward()
    case = {
        "out": torch.allclose(dout.full_tensor().cpu(), out.detach(), atol=1e-5),
        "backward_comms": comms.get_total_counts(),
        "device_ops": sorted(n for n in optrack.get_executed_ops() if "linear" in n),
        "grad_placements": [str(t.grad.placements[0]) for t in (dx, dw, db)],
        "grads": [torch.allclose(d.grad.full_tensor().cpu(), c.grad, atol=1e-5)
                  for d, c in zip((dx, dw, db), leaves)],
        "on_device": [d.grad.to_local().device.type for d in (dx, dw, db)],
    }
    facts["cases"][name] = case

dist.barrier()
dist.destroy_process_group()
print(json.dumps(facts))
