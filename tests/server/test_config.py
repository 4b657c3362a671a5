"""The model repository's configs as an adversary (or a typo) writes them: unknown fields
are refused naming the field and the accepted ones, and a malformed file makes
neuronmp-serve exit 2 naming the file and the field, never with a traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from neuronmp.server.config import load_model
from neuronmp.server.errors import ModelConfigError


def _model(tmp_path, name: str, content) -> str:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.pt").write_bytes(b"")
    data = content if isinstance(content, bytes) else \
        (content if isinstance(content, str) else json.dumps(content)).encode()
    (folder / name).write_bytes(data)
    return str(folder)


@pytest.mark.parametrize("name, content, field, accepted", [
    ("config.pbtxt", "max_batch_sise: 4\n", "max_batch_sise", "max_batch_size"),
    ("config.json", {"max_batch_sise": 4}, "max_batch_sise", "max_batch_size"),
    ("config.pbtxt", 'input [ { name: "x" data_type: TYPE_FP32 dim: [ 4 ] } ]\n',
     "input[0].dim", "dims"),
    ("config.json", {"dynamic_batching": {"max_queue_delay_microsecond": 5}},
     "dynamic_batching.max_queue_delay_microsecond", "max_queue_delay_microseconds"),
    ("config.pbtxt", "dynamic_batching { default_queue_policy { max_queue_sizes: 2 } }\n",
     "dynamic_batching.default_queue_policy.max_queue_sizes", "max_queue_size"),
    ("config.json", {"instance_group": [{"count": 1, "gpu": [0]}]}, "instance_group[0].gpu",
     "count"),
    ("config.pbtxt", "sequence_batching { }\n", "sequence_batching", "dynamic_batching"),
], ids=["pbtxt-top", "json-top", "tensor", "batching", "policy", "group", "unsupported"])
def test_an_unknown_field_is_refused_naming_it_and_the_accepted_ones(
        tmp_path, name, content, field, accepted):
    with pytest.raises(ModelConfigError) as err:
        load_model(_model(tmp_path, name, content))
    assert err.value.field == field, str(err.value)
    assert accepted in err.value.accepted, str(err.value)
    assert f"m/{name}: {field}" in str(err.value)


def test_the_fields_triton_configs_carry_are_accepted(tmp_path):
    cfg = load_model(_model(tmp_path, "config.pbtxt", """
name: "m"
platform: "pytorch_libtorch"
backend: "pytorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
version_policy: { latest: { num_versions: 1 } }
instance_group [ { name: "m_0" count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 100 preserve_ordering: false }
model_warmup [ { name: "w" batch_size: 1 } ]
parameters { key: "device_time_us" value: { string_value: "100" } }
"""))
    assert cfg.max_batch_size == 4 and cfg.device_time == "100"


_DIGITS = "9" * 5000


@pytest.mark.parametrize("name, content, says", [
    ("config.pbtxt", "a { " * 5000 + "}" * 5000, "nested"),
    ("config.json", "[" * 5000 + "]" * 5000, "nested"),
    ("config.json", [{"max_batch_size": 4}], "a JSON object"),
    ("config.pbtxt", b"max_batch_size: 4\n# caf\xe9\n", "UTF-8"),
    ("config.json", b'{"max_batch_size": 4, "name": "caf\xe9"}', "UTF-8"),
    ("config.pbtxt", f"max_batch_size: {_DIGITS}\n", "5000 digits"),
    ("config.json", f'{{"max_batch_size": {_DIGITS}}}', "5000 digits"),
], ids=["pbtxt-deep", "json-deep", "json-list", "pbtxt-latin1", "json-latin1",
        "pbtxt-digits", "json-digits"])
def test_a_malformed_config_exits_2_naming_the_file(tmp_path, name, content, says):
    folder = _model(tmp_path, name, content)
    res = subprocess.run([sys.executable, "-m", "neuronmp.serve", "--model-repository",
                          str(tmp_path), "--http-port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert f"{folder}/{name}: " in res.stderr and says in res.stderr, res.stderr
    assert "inf" not in res.stderr.split(": ", 1)[1], res.stderr


# neuronmp-serve as `python -m neuronmp.serve` runs it, reporting on exit which of the
# heavy packages it had imported
_IMPORTED_ON_EXIT = """
import runpy, sys
sys.argv = ["neuronmp-serve"] + sys.argv[1:]
try:
    runpy.run_module("neuronmp.serve", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    heavy = [m for m in ("torch", "numpy", "aiohttp", "grpc") if m in sys.modules]
    print(exc.code, heavy)
"""


@pytest.mark.parametrize("case", ["malformed-config", "no-directory", "bad-max-regions"])
def test_a_bad_repository_fails_before_torch_and_the_http_stack_are_imported(
        tmp_path, case):
    folder = _model(tmp_path, "config.pbtxt",
                    "max_batch_sise: 4\n" if case == "malformed-config" else "")
    repo = str(tmp_path / "missing") if case == "no-directory" else str(tmp_path)
    env = dict(os.environ)
    if case == "bad-max-regions":
        env["NEURONMP_SHM_MAX_REGIONS"] = "lots"
    res = subprocess.run([sys.executable, "-c", _IMPORTED_ON_EXIT, "--model-repository",
                          repo, "--http-port", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.stdout.strip() == "2 []", (res.stdout, res.stderr)
    says = {"malformed-config": f"{folder}/config.pbtxt: max_batch_sise",
            "no-directory": f"{repo}: --model-repository",
            "bad-max-regions": "NEURONMP_SHM_MAX_REGIONS"}[case]
    assert res.stderr.startswith("neuronmp-serve: ") and says in res.stderr, res.stderr
