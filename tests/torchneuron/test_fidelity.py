"""Where TorchNeuron refuses, the emulated device refuses the same way (class and message)."""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile


def test_binary_cross_entropy_is_banned_under_autocast(tmp_path):
    # TorchNeuron's autocast registers binary_cross_entropy as unsafe, as CUDA's does
    out = facts(run("""
        import json, torch, torch_neuronx
        p = torch.rand(4, device="neuron")
        t = torch.rand(4, device="neuron")
        outside = torch.nn.functional.binary_cross_entropy(p, t).device.type
        with torch.autocast("neuron", dtype=torch.bfloat16):
            try:
                torch.nn.functional.binary_cross_entropy(p, t)
                refused = None
            except RuntimeError as exc:
                refused = str(exc).splitlines()[0]
            with_logits = torch.nn.functional.binary_cross_entropy_with_logits(p, t).dtype
        print(json.dumps([outside, refused, str(with_logits)]))
        """, tmp_path))
    assert out == ["neuron", "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are "
                   "unsafe to autocast.", "torch.float32"]


def test_histc_out_of_another_dtype_names_both_as_torch_does(tmp_path):
    # TorchNeuron's histc kernel checks the dtypes itself, naming them as torch.float32
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.randn(100, device="neuron")
        hist = torch.zeros(10, device="neuron", dtype=torch.int32)
        try:
            torch.histc(x, bins=10, out=hist)
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        same = torch.histc(x, bins=10, out=torch.zeros(10, device="neuron")).sum().item()
        print(json.dumps([refused, same]))
        """, tmp_path))
    assert out == ["torch.histogram: input tensor and hist tensor should have the same dtype, "
                   "but got input torch.float32 and hist torch.int32", 100.0]


def test_copy_from_and_resize_follows_torchneurons_kernel(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        src = torch.randn(4, 5)
        dst = torch.empty(0, device="neuron")
        torch_neuronx.clear_op_tracking()
        same = torch._copy_from_and_resize(src, dst) is dst
        executed = sorted(torch_neuronx.get_executed_ops())
        copied = torch.equal(dst.cpu(), src)
        refusals = []
        for a, b in ((torch.randn(3), torch.empty(2, device="neuron")),
                     (torch.randn(2, device="neuron"), torch.empty(0))):
            try:
                torch._copy_from_and_resize(a, b)
                refusals.append(None)
            except RuntimeError as exc:
                refusals.append(str(exc).split(" but ")[0])
        print(json.dumps([same, "aten::resize_" in executed, copied, refusals]))
        """, tmp_path))
    assert out == [True, True, True, [
        "_copy_from_and_resize now only support copy with same size, or dst.numel() == 0!",
        "_copy_from_and_resize now only support copy from cpu tensor to neuron tensor,"]]
