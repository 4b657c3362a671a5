"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` and their cells on the ``neuron`` device equal
the CPU, forward and backward, through the fused-cell kernels of torchneuron.rnn.

Each script runs unmodified in a fresh interpreter with only NEURONMP_PROVIDE set, as
the other device tests do; it reports every case that differs from the CPU.
"""
from __future__ import annotations

import pytest
from torchneuron_support import facts, run

pytestmark = pytest.mark.timeout(900)

# Each case: a module built from the seed, the input's shape, the initial state (None,
# "h" or "hc"), and which outputs the loss reads ("all" or "first": a cell whose loss
# reads only h leaves the fused backward without a gradient for c).
RNN_CASES = """
import json, torch
from torch.testing import assert_close
nn = torch.nn
DEV = torch.device("neuron:{index}")
CASES = {{
    "LSTM": (lambda: nn.LSTM(4, 6), (5, 3, 4), None, "all"),
    "LSTM 2 layers bidirectional batch_first": (
        lambda: nn.LSTM(4, 6, 2, bidirectional=True, batch_first=True), (3, 5, 4), "hc", "all"),
    "LSTM 2 layers no bias": (lambda: nn.LSTM(4, 6, 2, bias=False), (5, 3, 4), None, "first"),
    "GRU": (lambda: nn.GRU(4, 6), (5, 3, 4), "h", "all"),
    "GRU 2 layers bidirectional batch_first": (
        lambda: nn.GRU(4, 6, 2, bidirectional=True, batch_first=True), (3, 5, 4), None, "all"),
    "GRU 2 layers no bias": (lambda: nn.GRU(4, 6, 2, bias=False), (5, 3, 4), None, "first"),
    "RNN tanh 2 layers bidirectional": (lambda: nn.RNN(4, 6, 2, bidirectional=True), (5, 3, 4),
                                        None, "all"),
    "RNN relu batch_first": (lambda: nn.RNN(4, 6, nonlinearity="relu", batch_first=True),
                             (3, 5, 4), None, "all"),
    "LSTMCell": (lambda: nn.LSTMCell(4, 6), (3, 4), "hc", "all"),
    "LSTMCell h only": (lambda: nn.LSTMCell(4, 6), (3, 4), None, "first"),
    "GRUCell": (lambda: nn.GRUCell(4, 6), (3, 4), "h", "all"),
    "GRUCell no bias": (lambda: nn.GRUCell(4, 6, bias=False), (3, 4), None, "all"),
}}


def tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for part in out for t in tensors(part)]


def state(module, kind, x):
    if kind is None:
        return ()
    if isinstance(module, nn.RNNCellBase):
        shape = (x.shape[0], module.hidden_size)
    else:
        dirs = 2 if module.bidirectional else 1
        shape = (module.num_layers * dirs, x.shape[0 if module.batch_first else 1],
                 module.hidden_size)
    h = torch.randn(shape, requires_grad=True)
    return (h,) if kind == "h" else ((h, torch.randn(shape, requires_grad=True)),)


def grads(module, x, extra, reads):
    outs = tensors(module(x, *extra))
    used = outs[:1] if reads == "first" else outs
    sum(t.pow(2).sum() for t in used).backward()
    return outs, [x.grad] + [t.grad for t in tensors(extra)] + [
        p.grad for p in module.parameters()]


def compare(make, shape, kind, reads):
    torch.manual_seed(0)
    ref = make()
    model = make()
    model.load_state_dict(ref.state_dict())
    model = model.to(DEV)
    x = torch.randn(shape, requires_grad=True)
    extra = state(ref, kind, x)
    x_dev = x.detach().to(DEV).requires_grad_()
    extra_dev = tuple(tuple(t.detach().to(DEV).requires_grad_() for t in e)
                      if isinstance(e, tuple) else e.detach().to(DEV).requires_grad_()
                      for e in extra)
    want_out, want_grad = grads(ref, x, extra, reads)
    got_out, got_grad = grads(model, x_dev, extra_dev, reads)
    assert len(got_out) == len(want_out) and len(got_grad) == len(want_grad)
    for got, want in zip(got_out + got_grad, want_out + want_grad):
        assert got.device == DEV, got.device
        assert_close(got.cpu(), want)


differ = {{}}
for name, case in CASES.items():
    try:
        compare(*case)
    except Exception as exc:   # every case reported, not only the first
        differ[name] = f"{{type(exc).__name__}}: {{exc}}"[:400]
print(json.dumps({{"cases": len(CASES), "differ": differ}}))
"""


@pytest.mark.parametrize("index", [0, 1])
def test_lstm_gru_rnn_and_cells_forward_and_backward_equal_cpu(tmp_path, index):
    out = facts(run(RNN_CASES.format(index=index), tmp_path))
    assert out == {"cases": 12, "differ": {}}


def test_double_backward_through_an_lstm_cell_equals_cpu(tmp_path):
    # create_graph=True makes autograd use PyTorch's composite backward of the fused
    # cell (recomputed from the gates), whose own backward then runs on the device
    out = facts(run("""
        import json, torch
        from torch.testing import assert_close
        torch.manual_seed(0)
        ref = torch.nn.LSTMCell(4, 6)
        model = torch.nn.LSTMCell(4, 6)
        model.load_state_dict(ref.state_dict())
        model = model.to("neuron")
        x = torch.randn(3, 4, requires_grad=True)
        x_dev = x.detach().to("neuron").requires_grad_()
        results = []
        for m, inp in ((ref, x), (model, x_dev)):
            g, = torch.autograd.grad(m(inp)[0].pow(2).sum(), inp, create_graph=True)
            g.pow(2).sum().backward()
            results.append([g.detach().cpu(), inp.grad.cpu()]
                           + [p.grad.cpu() for p in m.parameters()])
        for got, want in zip(results[1], results[0]):
            assert_close(got, want)
        print(json.dumps({"device": str(x_dev.grad.device), "compared": len(results[1])}))
        """, tmp_path))
    assert out == {"device": "neuron:0", "compared": 6}
