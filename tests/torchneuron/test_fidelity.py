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
