"""SyncBatchNorm's five kernels and linear_backward on the device: each is listed by op
tracking as the one device op it is on TorchNeuron (not the ops it is written in here),
and computes what the CPU's batch normalization does."""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile

_INNER = {"aten::var_mean.correction", "aten::rsqrt", "aten::sub.Tensor", "aten::mul.Tensor",
          "aten::sum.dim_IntList", "aten::add.Tensor", "aten::mm", "aten::matmul"}


def test_forward_kernels_are_one_op_each_and_match_batch_norm(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, 3, 5, 5, generator=g)
        w, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
        xd, wd, bd = x.to("neuron"), w.to("neuron"), b.to("neuron")
        rm, rv = torch.zeros(3, device="neuron"), torch.ones(3, device="neuron")
        seen = {}
        torch_neuronx.clear_op_tracking()
        mean, invstd = torch.batch_norm_stats(xd, 1e-5)
        seen["stats"] = torch_neuronx.get_executed_ops()
        torch_neuronx.clear_op_tracking()
        # two "ranks" of the same statistics, one with a quarter of the elements
        counts = torch.tensor([100.0, 25.0], device="neuron")
        whole = torch.batch_norm_gather_stats_with_counts(
            xd, torch.stack([mean, mean]), torch.stack([invstd, invstd]), rm, rv, 0.1,
            1e-5, counts)
        seen["gather"] = torch_neuronx.get_executed_ops()
        torch_neuronx.clear_op_tracking()
        y = torch.batch_norm_elemt(xd, wd, bd, mean, invstd, 1e-5)
        seen["elemt"] = torch_neuronx.get_executed_ops()
        var, mu = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        want = torch.nn.functional.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
        print(json.dumps([seen, {
            "mean": bool(torch.allclose(mean.cpu(), mu, atol=1e-6)),
            "invstd": bool(torch.allclose(invstd.cpu(), torch.rsqrt(var + 1e-5), atol=1e-5)),
            "gathered": bool(torch.allclose(whole[0].cpu(), mu, atol=1e-6)
                             and torch.allclose(whole[1].cpu(), invstd.cpu(), atol=1e-5)),
            "running_mean": bool(torch.allclose(rm.cpu(), 0.1 * mu, atol=1e-6)),
            "elemt": bool(torch.allclose(y.cpu(), want, atol=1e-5))}]))
        """, tmp_path))
    seen, close = out
    for key, op in (("stats", "aten::batch_norm_stats"),
                    ("gather", "aten::batch_norm_gather_stats_with_counts"),
                    ("elemt", "aten::batch_norm_elemt")):
        assert op in seen[key], (key, seen[key])
        assert not _INNER & set(seen[key]), (key, seen[key])
    assert close == {"mean": True, "invstd": True, "gathered": True, "running_mean": True,
                     "elemt": True}


def test_backward_kernels_are_one_op_each_and_give_batch_norms_gradients(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        g = torch.Generator().manual_seed(2)
        x = torch.randn(4, 3, 5, 5, generator=g, requires_grad=True)
        w = torch.randn(3, generator=g, requires_grad=True)
        b = torch.randn(3, generator=g, requires_grad=True)
        dy = torch.randn(4, 3, 5, 5, generator=g)
        torch.nn.functional.batch_norm(x, None, None, w, b, training=True,
                                       eps=1e-5).backward(dy)
        xd, wd, dyd = x.detach().to("neuron"), w.detach().to("neuron"), dy.to("neuron")
        mean, invstd = torch.batch_norm_stats(xd, 1e-5)
        seen = {}
        torch_neuronx.clear_op_tracking()
        # every mask off: TorchNeuron's kernel still gives all four
        masked = torch.batch_norm_backward_reduce(dyd, xd, mean, invstd, wd, False, False,
                                                  False)
        seen["reduce"] = torch_neuronx.get_executed_ops()
        sum_dy, sum_dy_xmu, grad_w, grad_b = masked
        count = torch.tensor([100], dtype=torch.int32, device="neuron")
        torch_neuronx.clear_op_tracking()
        grad_x = torch.batch_norm_backward_elemt(dyd, xd, mean, invstd, wd, sum_dy,
                                                 sum_dy_xmu, count)
        seen["elemt"] = torch_neuronx.get_executed_ops()
        torch_neuronx.clear_op_tracking()
        lx, lw, ldy = torch.randn(5, 4), torch.randn(3, 4), torch.randn(5, 3)
        lin = torch.ops.aten.linear_backward(lx.to("neuron"), ldy.to("neuron"),
                                             lw.to("neuron"), [True, True, True])
        seen["linear"] = torch_neuronx.get_executed_ops()
        print(json.dumps([seen, [t is not None and list(t.shape) == [3] for t in masked], {
            "grad_x": bool(torch.allclose(grad_x.cpu(), x.grad, atol=1e-5)),
            "grad_w": bool(torch.allclose(grad_w.cpu(), w.grad, atol=1e-4)),
            "grad_b": bool(torch.allclose(grad_b.cpu(), b.grad, atol=1e-4)),
            "linear": [bool(torch.allclose(a.cpu(), e, atol=1e-5)) for a, e in
                       zip(lin, (ldy @ lw, ldy.t() @ lx, ldy.sum(0)))]}]))
        """, tmp_path))
    seen, shapes, close = out
    for key, op in (("reduce", "aten::batch_norm_backward_reduce"),
                    ("elemt", "aten::batch_norm_backward_elemt"),
                    ("linear", "aten::linear_backward")):
        assert op in seen[key], (key, seen[key])
        assert not _INNER & set(seen[key]), (key, seen[key])
    assert shapes == [True] * 4
    assert close == {"grad_x": True, "grad_w": True, "grad_b": True,
                     "linear": [True] * 3}
