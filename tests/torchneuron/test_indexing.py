"""What op tracking lists for ``aten::index`` on the device (csrc/indexing.h): a mask on
the device is turned into integer indices by ``nonzero`` (listed), and a mask that
selects nothing gives the empty result without the index kernel (not listed), unless an
argument is empty itself."""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile


def test_masks_list_nonzero_and_an_empty_selection_lists_no_index(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        g = torch.Generator().manual_seed(4)
        x_cpu = torch.randn(3, 4, generator=g)
        x = x_cpu.to("neuron")
        cases = {"none": torch.zeros(3, 4, dtype=torch.bool),
                 "some": x_cpu > 0,
                 "ints": torch.tensor([2, 0]),
                 "no ints": torch.tensor([], dtype=torch.long)}
        seen = {}
        for name, idx in cases.items():
            on = idx.to("neuron")
            torch_neuronx.clear_op_tracking()
            got = x[on]
            ops = torch_neuronx.get_executed_ops()
            seen[name] = [sorted(o for o in ops if "index" in o or "nonzero" in o),
                          list(got.shape), bool(torch.equal(got.cpu(), x_cpu[idx]))]
        # a mask left on the CPU is turned into indices there: no nonzero on the device
        torch_neuronx.clear_op_tracking()
        x[cases["some"]]
        seen["cpu mask"] = sorted(o for o in torch_neuronx.get_executed_ops()
                                  if "index" in o or "nonzero" in o)
        print(json.dumps(seen))
        """, tmp_path))
    assert out["none"] == [["aten::nonzero"], [0], True]
    assert out["some"][0] == ["aten::index.Tensor", "aten::nonzero"] and out["some"][2]
    assert out["ints"] == [["aten::index.Tensor"], [2, 4], True]
    # an empty index tensor is listed: TorchNeuron records a call with an empty argument
    assert out["no ints"] == [["aten::index.Tensor"], [0, 4], True]
    assert out["cpu mask"] == ["aten::index.Tensor"]
