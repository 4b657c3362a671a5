"""neuronmp-serve's served models in process: the batch_buckets model parameter.

The model is loaded from a repository folder as the server loads it (config read and
checked, the trace loaded on its cores, a BatchingServer in front), without HTTP.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import neuronmp
from neuronmp.server.config import load_model
from neuronmp.server.errors import ModelConfigError
from neuronmp.server.models import ServedModel
from neuronmp.session import model as nmp_model


class Marked(torch.nn.Module):
    """Doubles its input, and says the batch size its graph was traced at."""

    def forward(self, x):
        return x * 2, torch.full((x.shape[0], 1), float(x.shape[0]))


def _folder(root, name, module, example, config=None, pbtxt=None, **trace_kw):
    (root / name / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.jit.save(neuronmp.trace(module, example, **trace_kw),
                       root / name / "1" / "model.pt")
    if config is not None:
        (root / name / "config.json").write_text(json.dumps(config))
    if pbtxt is not None:
        (root / name / "config.pbtxt").write_text(pbtxt)
    return str(root / name)


def _served(folder):
    return ServedModel(load_model(folder), 0)


def _markers(served, sizes):
    out = {}
    for rows in sizes:
        x = torch.rand(rows, 3)
        y, marker = served.server.infer(x)
        torch.testing.assert_close(y, x * 2)
        out[rows] = set(marker[:, 0].tolist())
    return out


class Pooled(torch.nn.Module):
    """Adds the batch's mean row: a graph that runs only the batch it was traced at."""

    def forward(self, x):
        return x + x.mean(0, keepdim=True)


PBTXT = 'parameters { key: "batch_buckets" value: { string_value: "1,4,8" } }\n'


def test_a_bucketed_trace_is_served_in_its_buckets_with_the_config_parameter(
        emulated, tmp_path):
    emulated("1x2")
    served = _served(_folder(tmp_path, "m", Marked(), torch.zeros(1, 3), pbtxt=PBTXT,
                             batch_buckets=(1, 4, 8)))
    try:
        assert served.cfg.max_batch_size == 8 and served.server.max_batch_size == 8
        assert served.config()["parameters"]["batch_buckets"] == {"string_value": "1,4,8"}
        assert _markers(served, [1, 2, 4, 5, 8]) == {
            1: {1.0}, 2: {4.0}, 4: {4.0}, 5: {8.0}, 8: {8.0}}
    finally:
        served.close()


def test_the_json_form_gives_buckets_to_a_trace_that_takes_any_batch(emulated, tmp_path):
    emulated("1x2")
    folder = _folder(tmp_path, "m", torch.nn.Linear(3, 3), torch.zeros(1, 3),
                     config={"parameters": {"batch_buckets": {"string_value": "1,2,16"}}})
    served = _served(folder)
    try:
        model = nmp_model.model_of(served.module)
        assert model.buckets == (1, 2, 16) and served.server.max_batch_size == 16
        model.bucket_runs.clear()
        x = torch.rand(5, 3)
        torch.testing.assert_close(served.server.infer(x), served.module(x))
        assert model.bucket_runs[16] >= 1
    finally:
        served.close()


@pytest.mark.parametrize("trace_kw, buckets, says", [
    ({"batch_buckets": (1, 4, 8)}, "1,4", "differs from the buckets the trace holds [1, 4, 8]"),
    ({"pooled": True}, "1,4", "needs a graph per bucket"),
    ({}, "4,1", "is not strictly increasing (4 then 1)"),
    ({}, "2,4", "does not hold the example's batch size 1"),
])
def test_a_batch_buckets_parameter_the_trace_cannot_run_is_refused(emulated, tmp_path,
                                                                    trace_kw, buckets, says):
    emulated("1x2")
    pbtxt = f'parameters {{ key: "batch_buckets" value: {{ string_value: "{buckets}" }} }}\n'
    trace_kw = dict(trace_kw)
    module = Pooled() if trace_kw.pop("pooled", False) else Marked()
    folder = _folder(tmp_path, "m", module, torch.zeros(1, 3), pbtxt=pbtxt, **trace_kw)
    with pytest.raises(ModelConfigError) as err:
        _served(folder)
    assert f"m/config.pbtxt: parameters.batch_buckets = '{buckets}' is not valid" \
        in str(err.value)
    assert says in str(err.value)


def test_a_batch_buckets_parameter_that_is_not_a_list_of_ints_is_refused(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"")
    (tmp_path / "m" / "config.pbtxt").write_text(PBTXT.replace("1,4,8", "1,four"))
    with pytest.raises(ModelConfigError, match="comma-separated list of batch sizes"):
        load_model(str(tmp_path / "m"))
