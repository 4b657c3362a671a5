"""Turning the device on: NEURONMP_PROVIDE=torchneuron, torch's autoload entry point,
the native torch_neuronx stand-in, and the conflict with the XLA-era one."""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile


def test_unset_variable_leaves_torch_alone(tmp_path):
    out = facts(run("""
        import json, sys, torch
        print(json.dumps({"neuron": hasattr(torch, "neuron"),
                          "backend": torch._C._get_privateuse1_backend_name(),
                          "ours": sorted(m for m in sys.modules
                                         if m.startswith(("neuronmp", "_neuronmp")))}))
        """, tmp_path, provide=None))
    # torch ran the entry point: only the standard-library hook module was imported
    assert out == {"neuron": False, "backend": "privateuseone", "ours": ["_neuronmp_provide"]}


def test_autoload_off_registers_only_at_import_torch_neuronx(tmp_path):
    out = facts(run("""
        import json, torch
        before = hasattr(torch, "neuron")
        import torch_neuronx
        print(json.dumps({"before": before, "after": torch.neuron.device_count(),
                          "file": torch_neuronx.__file__}))
        """, tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert out["before"] is False and out["after"] == 16
    assert out["file"].endswith("neuronmp/provide/torchneuron/__init__.py")


@pytest.mark.parametrize("autoload", ["1", "0"])
@pytest.mark.parametrize("first, then", [("torch_neuronx", "torch"), ("torch", "torch_neuronx")])
def test_torch_neuronx_and_torch_import_in_either_order(tmp_path, first, then, autoload):
    """TorchNeuron's own examples import torch_neuronx first.  The script reads
    sys.modules, so it runs in a fresh interpreter (never a warm fork that has torch)."""
    out = facts(run(f"""
        import json, sys
        fresh = "torch" not in sys.modules
        import {first}
        import {then}
        import torch
        x = torch.ones(3, device="neuron") * 2
        print(json.dumps({{"fresh": fresh, "device": str(x.device), "sum": x.sum().item(),
                          "count": torch.neuron.device_count()}}))
        """, tmp_path, NEURONMP_TOPOLOGY="1x2", TORCH_DEVICE_BACKEND_AUTOLOAD=autoload))
    assert out == {"fresh": True, "device": "neuron:0", "sum": 6.0, "count": 2}


@pytest.mark.parametrize("value", ["torch_neuronx,torchneuron", "torchneuron, torch_neuronx"])
def test_both_torch_neuronx_stand_ins_are_refused_naming_both(tmp_path, value):
    proc = run("""
        import json
        try:
            import torch_neuronx
        except ImportError as exc:
            print(json.dumps([type(exc).__name__, exc.variable, exc.value, list(exc.names)]))
        """, tmp_path, provide=value, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert facts(proc) == ["ProvideConflictError", "NEURONMP_PROVIDE", value,
                           ["torch_neuronx", "torchneuron"]]
    assert "asks for both torch_neuronx" in proc.stderr
    at_import_torch = run("import torch", tmp_path, provide=value)
    assert at_import_torch.returncode != 0
    assert "ProvideConflictError" in at_import_torch.stderr


def test_comma_list_with_torch_neuron_keeps_both(tmp_path):
    out = facts(run("""
        import json, torch
        x = torch.ones(2, device="neuron")
        import torch_neuronx
        try:
            import torch_neuron          # Inf1's package would take torch.neuron
            clash = None
        except ImportError as exc:
            clash = [type(exc).__name__, list(exc.names), exc.clash]
        print(json.dumps([str(x.device), torch_neuronx.__name__,
                          torch_neuronx.__file__.split("/")[-2], clash,
                          torch.neuron.device_count()]))
        """, tmp_path, provide="torchneuron,torch_neuron", TORCH_DEVICE_BACKEND_AUTOLOAD="1"))
    assert out == ["neuron:0", "torch_neuronx", "torchneuron",
                   ["ProvideConflictError", ["torch_neuron", "torchneuron"],
                    "both claim torch.neuron"], 16]


def test_a_child_forked_after_import_imports_nothing_at_its_first_test(tmp_path):
    """pytest --forked runs each test in a fork of the process that imported
    torch_neuronx: what the child's first tensor (the runtime's start-up) and
    torch.testing.assert_close need must already be loaded, as on hardware, where
    TorchNeuron's import loads DTensor."""
    out = facts(run("""
        import json, os, sys
        import torch, torch_neuronx
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            before = set(sys.modules)
            x = torch.ones(4, device="neuron") + 1
            torch.testing.assert_close(x.cpu(), torch.full((4,), 2.0))
            os.write(write, json.dumps(sorted(set(sys.modules) - before)).encode())
            os._exit(0)
        os.close(write)
        new = json.loads(os.read(read, 1 << 20) or b'"child failed"')
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status, "new": new}))
        """, tmp_path, NEURONMP_TOPOLOGY="1x2"))
    assert out == {"status": 0, "new": []}
