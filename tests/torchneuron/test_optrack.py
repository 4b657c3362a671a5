"""Op tracking: ``torch_neuronx.get_executed_ops`` lists the ops TorchNeuron would run on
the device (it has a device kernel for them), ``get_fallback_ops`` those it would run on
the CPU, each once, under the names TorchNeuron records."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ops_with_and_without_device_kernels(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.randn(4, 4, device="neuron")
        torch_neuronx.clear_op_tracking()
        y = torch.add(x, x)                       # a device kernel (aten::add.Tensor)
        d = torch.linalg.det(x)                   # none: TorchNeuron runs it on the CPU
        t = x.transpose(0, 1)                     # composed by torch over as_strided
        r = x.view(16)                            # a C++ view kernel: records nothing
        print(json.dumps([sorted(torch_neuronx.get_executed_ops()),
                          sorted(torch_neuronx.get_fallback_ops())]))
        """, tmp_path))
    executed, fallback = out
    assert "aten::add.Tensor" in executed and "aten::add.Tensor" not in fallback
    # torch's name of the overload that reached the device, as TorchNeuron's fallback has it
    assert "aten::_linalg_det.result" in fallback
    assert not any("linalg_det" in name for name in executed)
    assert not any(name.startswith(("aten::view", "aten::transpose", "aten::as_strided"))
                   for name in executed + fallback)


def test_composite_device_kernels_are_one_op(tmp_path):
    # TorchNeuron has kernels for linear and _to_copy: the ops torch composes them
    # from (t, addmm; empty_strided, copy_) are not listed
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.randn(3, 4, device="neuron", requires_grad=True)
        w = torch.randn(5, 4, device="neuron")
        torch_neuronx.clear_op_tracking()
        y = torch.nn.functional.linear(x, w)
        c = y.detach().cpu()
        executed = sorted(torch_neuronx.get_executed_ops())
        y.sum().backward()                        # autograd still flows through linear
        print(json.dumps([executed, x.grad.shape[0], x.grad.device.type]))
        """, tmp_path))
    executed, rows, device = out
    assert "aten::linear" in executed and "aten::_to_copy" in executed
    # allocations are listed (TorchNeuron's kernels allocate through the dispatcher too),
    # the compute ops linear is composed of are not
    assert set(executed) - {"aten::linear", "aten::_to_copy"} <= {"aten::empty",
                                                                  "aten::empty_strided"}
    assert (rows, device) == (3, "neuron")


def test_allocations_inside_a_composite_device_kernel_are_listed(tmp_path):
    # TorchNeuron's _to_copy kernel allocates its output through the dispatcher, so
    # moving a tensor to the device lists empty_strided beside _to_copy
    out = facts(run("""
        import json, torch, torch_neuronx
        cpu = torch.randn(2, 3)
        torch_neuronx.clear_op_tracking()
        x = cpu.to("neuron")
        print(json.dumps(sorted(torch_neuronx.get_executed_ops())))
        """, tmp_path))
    assert out == ["aten::_to_copy", "aten::empty_strided"]


def test_each_op_is_listed_once_and_clear_forgets(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.ones(3, device="neuron")
        torch_neuronx.clear_op_tracking()
        for _ in range(3):
            x = x + 1
        first = torch_neuronx.get_executed_ops()
        torch_neuronx.clear_op_tracking()
        cleared = torch_neuronx.get_executed_ops() + torch_neuronx.get_fallback_ops()
        x = x + 1                                 # recorded again after a clear
        print(json.dumps([first, cleared, torch_neuronx.get_executed_ops()]))
        """, tmp_path))
    first, cleared, again = out
    assert first.count("aten::add.Tensor") == 1 and len(first) == len(set(first))
    assert cleared == []
    assert "aten::add.Tensor" in again


def test_factories_and_resize_record_torchneurons_names(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        torch_neuronx.clear_op_tracking()
        a = torch.empty(2, 3, device="neuron")
        b = torch.empty_strided((2, 3), (1, 2), device="neuron")
        a.resize_(6)
        v = a[0].item()
        from torch_neuronx.utils import log_offloaded_op
        log_offloaded_op("custom::op")
        print(json.dumps([sorted(torch_neuronx.get_executed_ops()),
                          torch_neuronx.get_fallback_ops()]))
        """, tmp_path))
    assert out[0] == ["aten::_local_scalar_dense", "aten::empty", "aten::empty_strided",
                      "aten::resize_"]
    assert out[1] == ["custom::op"]


def test_registered_ops_come_from_the_coverage_data(tmp_path):
    out = facts(run("""
        import json
        from torch_neuronx.utils import get_neuron_registered_ops
        names = get_neuron_registered_ops(as_sorted=True)
        variants = get_neuron_registered_ops(keep_variant=True)
        print(json.dumps(["add" in names, "add.Tensor" in variants, "_linalg_det" in names,
                          names == sorted(names)]))
        """, tmp_path))
    assert out == [True, True, False, True]


def _fake_checkout(root: pathlib.Path) -> pathlib.Path:
    pkg = root / "torch_neuronx"
    (pkg / "csrc" / "core").mkdir(parents=True)
    (pkg / "python_ops" / "legacy").mkdir(parents=True)
    (pkg / "csrc" / "core" / "Bindings.cpp").write_text(
        'TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {\n'
        '  m.impl("clone", &clone_neuron);\n'
        '  // m.impl("copy_", &copy_neuron);\n'
        '  m.impl("view", &view_neuron);\n'
        '  m.impl("no_such_op", &nothing);\n'
        '}\n'
        'at::Tensor clone_neuron() { const std::string op_name = "aten::clone"; }\n')
    (pkg / "csrc" / "core" / "NeuronBindings.cpp").write_text(
        'static const std::unordered_set<std::string> VIEW_OPS_WHITELIST = {\n'
        '    "aten::view",  // reshaping\n    "aten::t",\n};\n')
    (pkg / "python_ops" / "binary.py").write_text(
        '@register_aten(["aten::mul.Tensor", "aten::mul.out"])\ndef f(x, y): pass\n'
        '@neuron_op("aten::relu")\nclass R: pass\n'
        'aten_lib.impl("gather", g, "PrivateUse1")\naten_lib.impl("gather", g, "Meta")\n')
    (pkg / "python_ops" / "legacy" / "old.py").write_text(
        '@neuron_op("aten::sin")\nclass S: pass\n')
    return root


def test_coverage_tool_reads_a_checkout(tmp_path):
    checkout = _fake_checkout(tmp_path / "checkout")
    out = tmp_path / "coverage.py"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "opcoverage.py"), str(checkout),
                           "--out", str(out), "--source", "a checkout"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data: dict = {}
    exec(out.read_text(), data)
    # the commented-out kernel, the op torch lacks and the legacy module are left out
    assert data["DEVICE_OPS"] == {"aten::clone", "aten::view", "aten::mul.Tensor",
                                  "aten::mul.out", "aten::relu", "aten::gather"}
    assert data["RECORDED_AS"] == {"aten::view": None}
    assert data["UNRECORDED_FALLBACK"] == {"aten::view", "aten::t"}
    assert "Source: a checkout" in out.read_text()


def test_coverage_tool_refuses_a_directory_that_is_no_checkout(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "opcoverage.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{tmp_path}: not a TorchNeuron checkout" in proc.stderr


def test_committed_coverage_matches_its_generator():
    # the data file is generated: the tool's rendering of it must give the same text
    import importlib.util

    spec = importlib.util.spec_from_file_location("opcoverage", ROOT / "tools" / "opcoverage.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from neuronmp.torchneuron import coverage

    text = (ROOT / "neuronmp" / "torchneuron" / "coverage.py").read_text()
    kernels = {k: coverage.RECORDED_AS.get(k, k) for k in coverage.DEVICE_OPS}
    source = text.split("Source: ", 1)[1].split("; checked", 1)[0]
    rendered = tool.render(kernels, set(coverage.UNRECORDED_FALLBACK), source)
    assert rendered.split("checked against")[0] == text.split("checked against")[0]
    assert rendered.split('"""', 2)[2] == text.split('"""', 2)[2]


def test_linear_keeps_torchs_derivative_linear_backward(tmp_path):
    # TorchNeuron's linear is a backend kernel, so autograd records torch's derivative
    # of linear (one linear_backward on the device), not those of t/matmul/addmm
    out = facts(run("""
        import json, torch, torch_neuronx
        g = torch.Generator().manual_seed(5)
        cpu = [torch.randn(2, 3, 4, generator=g), torch.randn(6, 4, generator=g),
               torch.randn(6, generator=g)]
        dev = [t.to("neuron").requires_grad_() for t in cpu]
        for t in cpu:
            t.requires_grad_()
        dy = torch.randn(2, 3, 6, generator=g)
        torch_neuronx.clear_op_tracking()
        y = torch.nn.functional.linear(*dev)
        forward = sorted(torch_neuronx.get_executed_ops())
        node = type(y.grad_fn).__name__
        dy_dev = dy.to("neuron")
        torch_neuronx.clear_op_tracking()
        y.backward(dy_dev)
        backward = sorted(torch_neuronx.get_executed_ops())
        torch.nn.functional.linear(*cpu).backward(dy)
        print(json.dumps([forward, node, backward, torch_neuronx.get_fallback_ops(),
                          [bool(torch.allclose(d.grad.cpu(), c.grad, atol=1e-5))
                           for d, c in zip(dev, cpu)],
                          [d.grad.device.type for d in dev]]))
        """, tmp_path))
    forward, node, backward, fallback, close, devices = out
    assert forward == ["aten::empty", "aten::linear"]
    assert node == "LinearBackward0"
    assert "aten::linear_backward" in backward
    assert not {"aten::mm", "aten::matmul", "aten::t", "aten::sum.dim_IntList"} & set(backward)
    assert fallback == []
    assert close == [True, True, True] and devices == ["neuron"] * 3


def test_a_python_device_kernel_is_one_op_and_nested_ones_record_themselves(tmp_path):
    # rms_norm (TorchNeuron's Python kernel) calls _fused_rms_norm through the
    # dispatcher: both are listed; the ops the fused kernel is written in here are not
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.randn(3, 8, device="neuron")
        w = torch.randn(8, device="neuron")
        torch_neuronx.clear_op_tracking()
        y = torch.nn.functional.rms_norm(x, (8,), w, 1e-6)
        executed = sorted(torch_neuronx.get_executed_ops())
        want = torch.nn.functional.rms_norm(x.cpu(), (8,), w.cpu(), 1e-6)
        torch_neuronx.clear_op_tracking()
        z = x + 1                                 # outside a kernel: recorded again
        print(json.dumps([executed, bool(torch.allclose(y.cpu(), want, atol=1e-6)),
                          torch_neuronx.get_executed_ops()]))
        """, tmp_path))
    executed, close, after = out
    assert {"aten::rms_norm", "aten::_fused_rms_norm"} <= set(executed)
    assert not {"aten::pow.Tensor_Scalar", "aten::mean.dim", "aten::rsqrt",
                "aten::mul.Tensor"} & set(executed)
    assert close
    assert "aten::add.Tensor" in after


def test_a_cast_on_the_device_lists_copy_as_torchneurons_cast_kernel(tmp_path):
    # TorchNeuron casts between dtypes of 32 bits or fewer on the device with a kernel it
    # records as copy_; a 64-bit cast goes through the host and lists no copy_
    out = facts(run("""
        import json, torch, torch_neuronx
        x = torch.arange(6, dtype=torch.float32, device="neuron")
        seen = {}
        for name in ("bfloat16", "int32", "float64", "float32"):
            torch_neuronx.clear_op_tracking()
            y = x.to(getattr(torch, name))
            seen[name] = ["aten::copy_" in torch_neuronx.get_executed_ops(),
                          y.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
        torch_neuronx.clear_op_tracking()
        x.cpu().to("neuron", torch.bfloat16)      # from the host: no cast on the device
        seen["from host"] = "aten::copy_" in torch_neuronx.get_executed_ops()
        print(json.dumps(seen))
        """, tmp_path))
    assert out == {"bfloat16": [True, True], "int32": [True, True], "float64": [False, True],
                   "float32": [False, True], "from host": False}
