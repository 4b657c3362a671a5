"""neuronmp.ops: the TorchScript ops a traced model's graph calls."""
import pytest
import torch

import neuronmp


class Outer(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 1


def test_a_scripted_caller_reaches_the_model_through_the_op():
    net = torch.nn.Linear(4, 2).eval()
    traced = neuronmp.trace(net, torch.rand(3, 4))
    scripted = torch.jit.script(Outer(traced))   # TorchScript calls neuronmp::forward
    x = torch.rand(3, 4)
    torch.testing.assert_close(scripted(x), net(x) + 1)
    assert "neuronmp::forward" in str(traced.graph)


def test_an_unknown_handle_is_a_clear_error():
    with pytest.raises(RuntimeError, match="handle 987654 is not registered in this process"):
        torch.ops.neuronmp.forward(987654, [torch.zeros(1)])
