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


# -- Trainium's refusals and numerics, and NEURONMP_TORCHNEURON_RELAXED=1 that lifts them

_TRAINIUM = """
    import json, math, torch, torch_neuronx

    def outcome(fn):
        try:
            out = fn()
        except (RuntimeError, ValueError) as exc:
            return [type(exc).__name__, str(exc).split(" (")[0]]
        return [v if not isinstance(v, float) or math.isfinite(v) else str(v)
                for v in out.cpu().reshape(-1).tolist()]

    ints = torch.arange(4, dtype=torch.int32, device="neuron").reshape(2, 2)
    special = torch.tensor([float("nan"), -1.0, 0.0, float("inf")], device="neuron")
    third = torch.tensor([1 / 3], dtype=torch.float64, device="neuron")
    print(json.dumps({
        "int matmul": outcome(lambda: ints @ ints),
        "int64 bmm": outcome(lambda: torch.bmm(ints[None].long(), ints[None].long())),
        "float matmul": outcome(lambda: ints.float() @ ints.float()),
        "int16 linear": outcome(lambda: torch.nn.functional.linear(
            ints.short(), ints.short(), ints[0].short()).to(torch.float32)),
        "complex": outcome(lambda: torch.isfinite(torch.tensor([1 + 2j], device="neuron"))),
        "complex moved back": torch.view_as_real(
            torch.tensor([1 + 2j], device="neuron").cpu()).tolist(),
        "relu": outcome(lambda: torch.relu(special)),
        "relu_": outcome(lambda: special.clone().relu_()),
        "clamp": outcome(lambda: torch.clamp(special, -0.5, 2.0)),
        "clamp_min": outcome(lambda: torch.clamp_min(special, 3.0)),
        "clamp_max": outcome(lambda: torch.clamp_max(special, -2.0)),
        "sign": outcome(lambda: torch.sign(special)),
        "ceil": outcome(lambda: torch.ceil(special)),
        "float64 times 3": (third * 3).cpu().item(),
        "float64 kept": third.cpu().item(),
        "float64 in place": third.clone().mul_(3).cpu().item(),
    }))
"""


def test_trainium_refuses_and_rounds_as_torchneuron_does_by_default(tmp_path):
    out = facts(run(_TRAINIUM, tmp_path))
    compiler = ["RuntimeError", "Execution failed: NEFF compilation failed: aten::mm.out of "
                "torch.int32 tensors: Internal tensorizer error: "
                "LegalizeType:int64/uint64/int32/uint32 matmult is not supported!"]
    assert out["int matmul"] == compiler
    assert out["int64 bmm"][0] == "RuntimeError" and "torch.int64" in out["int64 bmm"][1]
    assert out["float matmul"] == [2.0, 3.0, 6.0, 11.0]
    # TorchNeuron's linear runs int16 on the device, exact
    assert out["int16 linear"] == [1.0, 4.0, 3.0, 14.0]
    assert out["complex"][0] == "ValueError"
    assert out["complex"][1] == "Unsupported PyTorch dtype: torch.complex64"
    assert out["complex moved back"] == [[1.0, 2.0]]   # copies keep complex tensors whole
    assert out["relu"] == out["relu_"] == [0.0, 0.0, 0.0, "inf"]
    assert out["clamp"] == [-0.5, -0.5, 0.0, 2.0]
    assert out["clamp_min"] == [3.0, 3.0, 3.0, "inf"]
    assert out["clamp_max"] == [-2.0, -2.0, -2.0, -2.0]
    assert out["sign"] == ["nan", -1.0, 0.0, 1.0]
    assert out["ceil"] == [-2147483648.0, -1.0, 0.0, -2147483648.0]
    f32 = float(__import__("numpy").float32(1 / 3))
    assert out["float64 kept"] == 1 / 3   # moving to and from the device is exact
    assert out["float64 times 3"] == float(__import__("numpy").float32(f32 * 3))
    assert out["float64 in place"] == out["float64 times 3"]


def test_relaxed_setting_runs_what_trainium_refuses_with_the_cpus_numerics(tmp_path):
    out = facts(run(_TRAINIUM, tmp_path, NEURONMP_TORCHNEURON_RELAXED="1"))
    assert out["int matmul"] == [2, 3, 6, 11]
    assert out["int64 bmm"] == [2, 3, 6, 11]
    assert out["complex"] == [True]
    assert out["relu"] == out["relu_"] == ["nan", 0.0, 0.0, "inf"]
    assert out["clamp"] == ["nan", -0.5, 0.0, 2.0]
    assert out["clamp_min"][0] == "nan" and out["clamp_max"][0] == "nan"
    assert out["sign"] == [0.0, -1.0, 0.0, 1.0]
    assert out["ceil"] == ["nan", -1.0, 0.0, "inf"]
    assert out["float64 times 3"] == out["float64 in place"] == 1 / 3 * 3


def test_relaxed_setting_refuses_a_value_other_than_0_or_1(tmp_path):
    proc = run("import torch_neuronx", tmp_path, NEURONMP_TORCHNEURON_RELAXED="yes")
    assert proc.returncode != 0
    assert "NEURONMP_TORCHNEURON_RELAXED" in proc.stderr and "'yes'" in proc.stderr
