"""neuronmp.trace / dynamic_batch: the fused-op ScriptModule, save/load, fixed signatures.

Every test runs on real worker processes (the pool of the test's runtime); which core
ran a call is read from the pool's per-core counters.
"""
from __future__ import annotations

import collections
import gc
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from api_support import Net, ran_on
from api_support import served as _served

import neuronmp
from neuronmp.errors import BatchBucketsError
from neuronmp.host import runtime
from neuronmp.pool import archive
from neuronmp.session import model as nmp_model
from neuronmp.session import session


@pytest.fixture
def four_cores(emulated):
    return emulated("1x4")


def test_sdk_examples_function_and_module_compilation(four_cores, tmp_path):
    def func(x, y):
        return 2 * x + y

    example_inputs = torch.rand(3), torch.rand(3)
    trace = neuronmp.trace(func, example_inputs)
    torch.jit.save(trace, tmp_path / "func.pt")
    loaded = torch.jit.load(tmp_path / "func.pt")
    a, b = torch.rand(3), torch.rand(3)
    assert torch.allclose(loaded(a, b), 2 * a + b)

    model = Net().eval()
    trace = neuronmp.trace(model, torch.rand(1, 1, 3, 3))
    torch.jit.save(trace, tmp_path / "model.pt")
    loaded = torch.jit.load(tmp_path / "model.pt")
    x = torch.rand(1, 1, 3, 3)
    assert torch.allclose(loaded(x), model(x).detach(), atol=1e-5)
    assert isinstance(loaded, torch.jit.ScriptModule)
    # one fused op carries the whole graph: no convolution left in the outer graph
    kinds = [n.kind() for n in loaded.graph.nodes()]
    assert kinds.count("neuronmp::forward") == 1
    assert not any(k.startswith("aten::conv") for k in kinds)


def test_pytree_outputs_round_trip(four_cores, tmp_path):
    def func(a, b):
        return {"sum": a + b, "pair": (a * b, [a - b])}

    a, b = torch.rand(2, 3), torch.rand(2, 3)
    trace = neuronmp.trace(func, (a, b))
    torch.jit.save(trace, tmp_path / "tree.pt")
    for model in (trace, torch.jit.load(tmp_path / "tree.pt")):
        out = model(a, b)
        assert set(out) == {"sum", "pair"}
        assert torch.allclose(out["sum"], a + b)
        assert torch.allclose(out["pair"][0], a * b)
        assert torch.allclose(out["pair"][1][0], a - b)


def test_fixed_shapes_and_dtypes_are_refused(four_cores, tmp_path):
    trace = neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3))
    with pytest.raises(ValueError, match=r"shape \[2, 1, 3, 3\].*traced with \[1, 1, 3, 3\]"):
        trace(torch.rand(2, 1, 3, 3))
    with pytest.raises(ValueError, match="dtype float64.*traced with float32"):
        trace(torch.rand(1, 1, 3, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="takes 1 input tensor"):
        trace(torch.rand(1, 1, 3, 3), torch.rand(1))
    # through the TorchScript interpreter (a loaded model) the same message arrives
    torch.jit.save(trace, tmp_path / "m.pt")
    loaded = torch.jit.load(tmp_path / "m.pt")
    with pytest.raises(RuntimeError, match=r"ValueError: .*shape \[1, 1, 4, 4\]"):
        loaded(torch.rand(1, 1, 4, 4))


def test_compiler_workdir_and_args(four_cores, tmp_path):
    work = tmp_path / "work"
    trace = neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3), compiler_workdir=str(work),
                           compiler_args="--optlevel 2 --auto-cast none")
    meta = json.loads((work / "metadata.json").read_text())
    assert meta["inputs"] == [[[1, 1, 3, 3], "float32"]]
    assert meta["outputs"] == 0
    assert meta["compiler_args"] == ["--optlevel", "2", "--auto-cast", "none"]
    graph = torch.jit.load(work / "graph.pt")      # the graph a core runs: (chunks, *inputs)
    x = torch.rand(1, 1, 3, 3)
    assert torch.allclose(graph(1, x)[0], trace(x))

    neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3), compiler_args=["-O1"])
    with pytest.raises(TypeError, match="compiler_args.*got int: 3"):
        neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3), compiler_args=3)
    with pytest.raises(TypeError, match="element ''"):
        neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3), compiler_args=["-O1", ""])
    with pytest.raises(TypeError, match="example_inputs must be a tensor"):
        neuronmp.trace(Net().eval(), [])


def test_dynamic_batch_sdk_example(four_cores):
    n = Net().eval()
    inputs = torch.rand(1, 1, 3, 3)
    inputs_batch_8 = torch.rand(8, 1, 3, 3)
    neuron_net = neuronmp.trace(n, inputs)
    neuron_net_dynamic_batch = neuronmp.dynamic_batch(neuron_net)
    assert neuron_net_dynamic_batch is neuron_net
    output_batch_8 = neuron_net_dynamic_batch(inputs_batch_8)
    assert output_batch_8.shape == (8, 1, 1, 1)
    assert torch.allclose(output_batch_8, n(inputs_batch_8).detach(), atol=1e-5)


def test_dynamic_batch_pads_and_uses_all_the_models_cores(four_cores):
    n = Net().eval()
    model = neuronmp.dynamic_batch(neuronmp.trace(n, torch.rand(2, 1, 3, 3)))
    neuronmp.set_neuron_cores(model, start_nc=0, nc_count=2)
    x = torch.rand(7, 1, 3, 3)                     # 4 chunks of 2, the last one padded
    out, served = _served(lambda: model(x))
    assert out.shape == (7, 1, 1, 1)
    assert torch.allclose(out, n(x).detach(), atol=1e-5)
    cores = runtime.get_runtime().cores
    assert served == {cores[0]: 1, cores[1]: 1}   # one request per core, chunks looped there


def test_dynamic_batch_value_errors(four_cores):
    model = neuronmp.dynamic_batch(neuronmp.trace(Net().eval(), torch.rand(2, 1, 3, 3)))
    with pytest.raises(ValueError, match=r"shape \[2, 1, 7, 3\].*only dimension 0"):
        model(torch.rand(2, 1, 7, 3))

    two = neuronmp.dynamic_batch(neuronmp.trace(lambda a, b: a + b,
                                                (torch.rand(1, 2), torch.rand(1, 2))))
    with pytest.raises(ValueError, match=r"same dim-0 size.*\[3, 2\]"):
        two(torch.rand(3, 2), torch.rand(2, 2))

    uneven = neuronmp.trace(lambda a, b: a.sum() + b.sum(), (torch.rand(1, 2), torch.rand(3, 2)))
    with pytest.raises(ValueError, match="share its dim-0 size"):
        neuronmp.dynamic_batch(uneven)
    with pytest.raises(ValueError, match="no neuronmp subgraph"):
        neuronmp.dynamic_batch(Net())


def test_released_model_frees_its_core(four_cores):
    model = neuronmp.trace(Net().eval(), torch.rand(1, 1, 3, 3))
    used = session.current().book.usage()
    assert sum(used) == 1
    del model
    gc.collect()
    assert sum(session.current().book.usage()) == 0


def test_import_neuronmp_registers_op_once_torch_is_imported(procs):
    code = textwrap.dedent("""
        import sys
        import neuronmp
        assert 'torch' not in sys.modules
        import torch
        print(torch.ops.neuronmp.forward.default._schema)
    """)
    p = procs.python(code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "neuronmp::forward(int handle, Tensor[] inputs) -> Tensor[]" in out


def test_saved_model_runs_in_fresh_process_on_chosen_core(four_cores, procs, tmp_path):
    n = Net().eval()
    x = torch.rand(1, 1, 3, 3)
    torch.save(x, tmp_path / "x.pt")
    torch.jit.save(neuronmp.trace(n, x), tmp_path / "model.pt")
    runtime.shutdown()                   # give the cores back for the subprocess
    code = textwrap.dedent(f"""
        import json, time, neuronmp, torch
        from neuronmp import ops
        from neuronmp.host import runtime
        from neuronmp.session.session import current as _current_session
        with neuronmp.neuron_cores_context(start_nc=1):
            model = torch.jit.load({str(tmp_path / "model.pt")!r})
        pool = _current_session().pool
        def settled():
            while any(s.in_flight for s in pool.stats()):
                time.sleep(0.001)
            return {{s.core: s.done for s in pool.stats()}}
        before = settled()
        out = model(torch.load({str(tmp_path / "x.pt")!r}))
        after = settled()
        torch.save(out, {str(tmp_path / "out.pt")!r})
        print(json.dumps({{c: after[c] - before[c] for c in after if after[c] != before[c]}}))
    """)
    p = procs.python(code, env={"NEURON_RT_VISIBLE_CORES": "2-3"})
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"3": 1}   # nc:1 of 2-3 is global 3
    assert torch.allclose(torch.load(tmp_path / "out.pt"), n(x).detach(), atol=1e-5)
    assert os.path.exists(tmp_path / "model.pt")
    assert "torch" in sys.modules


def test_strict_deprecation_warnings_do_not_break_neuronmps_own_torchscript(procs, tmp_path):
    # neuronmp uses torch.jit (deprecated in torch 2.13) inside trace and in every
    # worker's model load; under -W error (strict CI, inherited by the workers)
    # only the user's own torch.jit calls may warn
    code = textwrap.dedent(f"""
        import warnings, torch, neuronmp
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        x = torch.rand(1, 4)
        traced = neuronmp.trace(net, x)
        assert torch.allclose(traced(x), net(x))
        neuronmp.dynamic_batch(traced)
        assert traced(torch.rand(3, 4)).shape == (3, 4)
        dp = neuronmp.DataParallel(neuronmp.trace(net, x))
        assert dp(torch.rand(4, 4)).shape == (4, 4)
        wrapped = torch.nn.Sequential(neuronmp.trace(net, x), torch.nn.Identity())
        assert neuronmp.DataParallel(wrapped)(torch.rand(4, 4)).shape == (4, 4)
        try:
            torch.jit.save(traced, {str(tmp_path / "m.pt")!r})
        except DeprecationWarning as w:   # the user's own call: torch's warning stands
            print("user call warned:", w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(traced, {str(tmp_path / "m.pt")!r})
            loaded = torch.jit.load({str(tmp_path / "m.pt")!r})
        neuronmp.set_neuron_cores(loaded, start_nc=1, nc_count=1)
        assert torch.allclose(loaded(x), net(x))
        print("ok")
    """)
    p = procs.popen([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0-1"})
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0, err[-3000:]
    assert "user call warned: `torch.jit.save` is deprecated" in out
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_one_dimensional_unsigned_inputs_trace_and_run(four_cores, dtype):
    # torch has no flip for these dtypes: the batch check must not need one
    class Twice(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.int64) * 2

    x = torch.tensor([1, 2, 3, 40000], dtype=dtype)
    traced = neuronmp.trace(Twice(), x)
    assert torch.equal(traced(x), Twice()(x))


# -- batch buckets: one graph per batch size ------------------------------------------

BUCKETS = (1, 4, 8, 16, 32)


class Marked(torch.nn.Module):
    """A linear layer, and a second output that holds the batch size it was traced at
    (``float()`` bakes it into each bucket's graph): which bucket's graph ran."""

    def __init__(self, features: int = 6):
        super().__init__()
        self.lin = torch.nn.Linear(features, 3)

    def forward(self, x):
        return self.lin(x), torch.full((x.shape[0], 1), float(x.shape[0]))


def _bucketed(net, example, buckets=BUCKETS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return neuronmp.trace(net, example, batch_buckets=buckets)


def _expected_pieces(rows, buckets, cores=1):
    """The bucket each row ran in, written out independently of chunking."""
    largest, out = buckets[-1], []
    if -(-rows // largest) < cores:
        per, extra = divmod(rows, min(cores, rows))
        sizes = [per + 1] * extra + [per] * (min(cores, rows) - extra)
    else:
        sizes = [largest] * (rows // largest) + ([rows % largest] if rows % largest else [])
    for n in sizes:
        out.append((n, min(b for b in buckets if b >= n)))
    return out


def _check_bucketed_call(traced, net, rows, cores=1):
    x = torch.rand(rows, 6)
    (y, marker), served_by = _served(lambda: traced(x))
    pieces = _expected_pieces(rows, BUCKETS, cores)
    torch.testing.assert_close(y, net(x)[0].detach())       # padding stripped: r rows
    assert marker.shape == (rows, 1)
    want = torch.cat([torch.full((n, 1), float(b)) for n, b in pieces])
    assert torch.equal(marker, want), (rows, pieces)
    assert sum(served_by.values()) == len(pieces)            # one message per piece
    return pieces


def test_batch_buckets_run_the_smallest_bucket_that_holds_each_batch(four_cores):
    torch.manual_seed(0)
    net = Marked().eval()
    traced = _bucketed(net, torch.rand(1, 6))
    model = nmp_model.model_of(traced)
    assert model.buckets == BUCKETS and model.meta["batch_buckets"] == list(BUCKETS)
    for rows in [*range(1, 33), 33, 40, 64, 65, 100]:    # every size, then split
        model.bucket_runs.clear()
        pieces = _check_bucketed_call(traced, net, rows)
        assert model.bucket_runs == collections.Counter(b for _, b in pieces)
    assert _expected_pieces(70, BUCKETS) == [(32, 32), (32, 32), (6, 8)]


def test_batch_buckets_spread_a_batch_over_the_models_cores(four_cores):
    torch.manual_seed(0)
    net = Marked().eval()
    traced = _bucketed(net, torch.rand(4, 6))
    neuronmp.set_multicore(traced)
    for rows in (1, 3, 6, 32, 33, 100, 128, 130):
        _check_bucketed_call(traced, net, rows, cores=4)
    _, served_by = _served(lambda: traced(torch.rand(32, 6)))
    assert len(served_by) == 4                               # 4 pieces of 8 rows


def test_batch_buckets_save_load_and_placement(four_cores, tmp_path):
    torch.manual_seed(0)
    net = Marked().eval()
    torch.jit.save(_bucketed(net, torch.rand(8, 6)), tmp_path / "b.pt")
    loaded = torch.jit.load(tmp_path / "b.pt")
    assert nmp_model.model_of(loaded).buckets == BUCKETS
    for rows in (1, 5, 8, 17, 40):
        _check_bucketed_call(loaded, net, rows)
    neuronmp.set_neuron_cores(loaded, 2, 1)
    core, (_, marker) = ran_on(lambda: loaded(torch.rand(3, 6)))
    assert core == 2 and torch.equal(marker, torch.full((3, 1), 4.0))
    # (through the TorchScript interpreter, as for any loaded trace: a RuntimeError)
    with pytest.raises(RuntimeError, match="only dimension 0 may differ"):
        loaded(torch.rand(3, 7))


def test_batch_buckets_share_the_weights_in_the_artifact(four_cores, tmp_path):
    net = torch.nn.Linear(256, 256)
    plain = neuronmp.trace(net, torch.rand(1, 256))
    bucketed = neuronmp.trace(net, torch.rand(1, 256), batch_buckets=BUCKETS)
    torch.jit.save(plain, tmp_path / "plain.pt")
    torch.jit.save(bucketed, tmp_path / "bucketed.pt")
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    plain_size = os.path.getsize(tmp_path / "plain.pt")
    # five graphs, one copy of the weights: the graphs' code is all that is added
    assert os.path.getsize(tmp_path / "bucketed.pt") < plain_size + weights / 2
    x = torch.rand(5, 256)
    torch.testing.assert_close(torch.jit.load(tmp_path / "bucketed.pt")(x), net(x).detach())
    # and the cores map one copy: the shared-weights reader finds each tensor once
    found = archive.split(bytes(nmp_model.model_of(bucketed).graph))
    assert found is not None and len(found.entries) == 2
    assert weights <= found.size < weights + 4096


@pytest.mark.parametrize("buckets, says", [
    ([], "is empty"),
    ((4, 2), "is not strictly increasing (4 then 2)"),
    ((1, 1, 2), "is not strictly increasing (1 then 1)"),
    ((0, 1), "holds 0, not a batch size >= 1"),
    ((1, -4), "holds -4, not a batch size >= 1"),
    ((1, 2.0), "holds 2.0, not a batch size >= 1"),
    ((True, 2), "holds True, not a batch size >= 1"),
    ("1,4", "is a str, not a list or tuple of ints"),
    (8, "is a int, not a list or tuple of ints"),
    ((2, 4), "does not hold the example's batch size 1"),
])
def test_bad_batch_buckets_are_refused_naming_the_value(buckets, says):
    with pytest.raises(BatchBucketsError) as err:
        neuronmp.trace(torch.nn.Linear(3, 2), torch.rand(1, 3), batch_buckets=buckets)
    assert isinstance(err.value, ValueError)
    assert f"batch_buckets={buckets!r} {says}" in str(err.value)
    assert "strictly increasing sequence of batch sizes >= 1" in str(err.value)
    again = pickle.loads(pickle.dumps(err.value))
    assert str(again) == str(err.value) and again.reason == err.value.reason


def test_batch_buckets_need_inputs_that_share_a_batch_size():
    with pytest.raises(BatchBucketsError, match="share their dim-0"):
        neuronmp.trace(lambda a, b: a + b.sum(), (torch.rand(2, 3), torch.rand(3, 3)),
                       batch_buckets=(2, 4))


def test_replace_weights_changes_every_buckets_graph(four_cores, tmp_path):
    torch.manual_seed(0)
    first, second = Marked().eval(), Marked().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = neuronmp.trace(first, torch.rand(1, 6), batch_buckets=BUCKETS,
                                inline_weights_to_neff=False)
    neuronmp.replace_weights(traced, second.state_dict())
    torch.jit.save(traced, tmp_path / "replaced.pt")
    for model in (traced, torch.jit.load(tmp_path / "replaced.pt")):
        for rows in (1, 3, 8, 20, 40):                  # every bucket's graph, and a split
            x = torch.rand(rows, 6)
            torch.testing.assert_close(model(x)[0], second(x)[0].detach())


def _linear_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).eval()


def _graph_weights(traced):
    graph = bytes(nmp_model.model_of(traced).graph)
    runner = torch.jit.load(io.BytesIO(graph))
    return graph, {n: p for n, p in runner.named_parameters() if n.endswith("weight")}


def test_optlevel_3_lays_the_linear_weights_out_for_the_matmul_once_for_every_bucket(
        four_cores):
    net = _linear_net()
    fast = neuronmp.trace(net, torch.rand(8, 64), batch_buckets=(1, 4, 8),
                          compiler_args="--optlevel 3")
    graph, weights = _graph_weights(fast)
    # column-major: the transpose aten::linear multiplies by is contiguous
    assert len(weights) == 2 and all(w.stride() == (1, w.shape[0]) for w in weights.values())
    assert net[0].weight.stride() == (64, 1)          # the user's module is left alone
    # one copy for all the buckets' graphs, which the cores still share
    found = archive.split(graph)
    size = sum(p.numel() * p.element_size() for p in net.parameters())
    assert found is not None and size <= found.size < size + 4096
    for rows in (1, 3, 8, 11):                        # every bucket, and a split
        x = torch.rand(rows, 64)
        torch.testing.assert_close(fast(x), net(x).detach())


@pytest.mark.parametrize("args", [None, "--optlevel 2", "-O1", ["--optlevel=2"]])
def test_below_optlevel_3_the_weights_keep_torchs_layout(args):
    net = _linear_net()
    _, weights = _graph_weights(neuronmp.trace(net, torch.rand(8, 64), compiler_args=args))
    assert all(w.is_contiguous() for w in weights.values())


@pytest.mark.parametrize("args, value", [
    ("--optlevel 4", "'4'"), ("-Ox", "'x'"), ("--optlevel=fast", "'fast'"),
    ("--optlevel", "'(none)'"),
])
def test_a_bad_optlevel_is_refused_naming_it(args, value):
    with pytest.raises(ValueError) as err:
        neuronmp.trace(torch.nn.Linear(3, 2), torch.rand(1, 3), compiler_args=args)
    assert f"optimization level {value}" in str(err.value)
    assert "expected 1, 2 or 3" in str(err.value)
