"""neuronmp.session.model: the one request path every caller takes."""
from __future__ import annotations

import pytest
import torch

import neuronmp
from neuronmp.session import model as nmp_model
from neuronmp.session import session


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class BakesTheBatch(torch.nn.Module):
    """A trace of this keeps batch 1 in its graph (view(1, -1))."""

    def forward(self, x):
        return x.view(1, -1) * 2


def _requests_per_core(fn):
    pool = session.current().pool
    before = {s.core: s.submitted for s in pool.stats()}
    out = fn()
    after = {s.core: s.submitted for s in pool.stats()}
    return out, {c: after[c] - before[c] for c in after if after[c] != before[c]}


def test_dataparallel_on_a_batch_1_trace_sends_one_message_per_core():
    net = MLP().eval()
    traced = neuronmp.trace(net, torch.rand(1, 16))
    assert nmp_model.model_of(traced).meta["any_batch"] is True
    dp = neuronmp.DataParallel(traced)
    x = torch.rand(64, 16)
    out, sent = _requests_per_core(lambda: dp(x))
    torch.testing.assert_close(out, net(x))
    cores = neuronmp.visible_cores()
    assert sent == {c: 1 for c in cores}   # 64 / 16 cores: 4 rows each, one request each


def test_a_trace_that_bakes_its_batch_in_runs_chunk_by_chunk_and_stays_right():
    traced = neuronmp.dynamic_batch(neuronmp.trace(BakesTheBatch(), torch.rand(1, 3)))
    assert nmp_model.model_of(traced).meta["any_batch"] is False
    x = torch.rand(5, 3)
    torch.testing.assert_close(traced(x), x * 2)   # 5 calls of the traced batch


def test_submit_returns_a_future_and_the_check_names_the_bad_input():
    traced = neuronmp.trace(MLP().eval(), torch.rand(2, 16))
    model = nmp_model.model_of(traced)
    x = torch.rand(2, 16)
    answer = model.submit([x])
    assert isinstance(answer, __import__("concurrent.futures").futures.Future)
    torch.testing.assert_close(answer.result(timeout=30)[0], traced(x))
    with pytest.raises(ValueError, match=r"input 0 has shape \[3, 16\].*traced with \[2, 16\]"):
        model.submit([torch.rand(3, 16)])
    with pytest.raises(ValueError, match="input 0 has dtype float64"):
        model.submit([torch.rand(2, 16, dtype=torch.float64)])
    with pytest.raises(ValueError, match="is on meta"):
        model.submit([torch.empty(2, 16, device="meta")])
    with pytest.raises(TypeError, match="takes 1 input tensor"):
        model.submit([x, x])


def test_replica_pins_a_call_and_dynamic_overrides_for_one_call(emulated):
    emulated("1x2")
    traced = neuronmp.trace(MLP().eval(), torch.rand(2, 16))
    neuronmp.set_multicore(traced)
    model = nmp_model.model_of(traced)
    cores = neuronmp.visible_cores()
    x = torch.rand(6, 16)   # three traced batches, on one replica, in one message
    out, sent = _requests_per_core(
        lambda: model.submit([x], replica=1, dynamic=True).result(timeout=30))
    assert sent == {cores[1]: 1}
    torch.testing.assert_close(out[0], torch.cat([traced(x[i:i + 2]) for i in (0, 2, 4)]))
