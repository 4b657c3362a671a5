"""The public names TorchNeuron's users import from ``torch_neuronx`` besides the device
functions: ``utils``, ``neuron``, the op tracking functions, ``neuron_dynamo_backend``."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from torchneuron_support import env_with, facts, run

pytestmark = pytest.mark.timeout(900)   # the first test may wait for the one compile


def test_torch_neuronx_imported_before_torch_registers_the_device(tmp_path):
    # a script whose first import is torch_neuronx: torch's autoload then runs while
    # the stand-in is half imported; a fresh interpreter (never a warm fork, which
    # has torch imported already) is what shows the order
    code = textwrap.dedent("""
        import json, torch_neuronx, torch
        x = torch.ones(2, device="neuron")
        print(json.dumps([str(x.device), torch_neuronx.device_count() >= 1]))
        """)
    proc = subprocess.run([sys.executable, "-c", code], env=env_with(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert facts(proc) == ["neuron:0", True]


def test_neuron_module_is_torch_neuron(tmp_path):
    out = facts(run("""
        import json, torch, torch_neuronx
        from torch_neuronx import neuron
        import torch_neuronx.neuron as by_path
        print(json.dumps([neuron is torch.neuron, by_path is torch.neuron,
                          torch_neuronx.neuron.current_device(),
                          torch_neuronx.is_neuron_runtime_initialized()]))
        """, tmp_path))
    assert out == [True, True, 0, False]


def test_utils_switches_read_torchneurons_variables(tmp_path):
    script = """
        import json
        from torch_neuronx import utils
        print(json.dumps([utils.use_mlir_aten_ops(), utils.is_sync_mode_enabled(),
                          utils.is_stablehlo_enabled(), utils.get_platform_target(),
                          utils.get_worker_multiplier()]))
        """
    # registering the device turns the MLIR lowering on unless the user set it (as TorchNeuron)
    assert facts(run(script, tmp_path, NEURONMP_TOPOLOGY="trn2.48xlarge",
                     NEURON_LOGICAL_NC_CONFIG="2")) == [True, False, True, "trn2", 1]
    assert facts(run(script, tmp_path, TORCH_NEURONX_MLIR_ATEN_OPS="0"))[0] is False
    assert facts(run(script, tmp_path, NEURONMP_TOPOLOGY="trn2.48xlarge",
                     NEURON_LOGICAL_NC_CONFIG="1", TORCH_NEURONX_MLIR_ATEN_OPS="1",
                     NEURON_LAUNCH_BLOCKING="1", TORCH_NEURONX_ENABLE_STABLEHLO="false")
                 ) == [True, True, False, "trn2", 2]
    assert facts(run(script, tmp_path, NEURONMP_TOPOLOGY="trn1.32xlarge")
                 )[3:] == ["trn1", 1]


def test_bad_gmm_alignment_names_the_variable(tmp_path):
    out = facts(run("""
        import json
        from torch_neuronx import utils
        try:
            utils.get_gmm_align()
        except ValueError as exc:
            print(json.dumps(str(exc)))
        """, tmp_path, TORCH_NEURONX_ATEN_GMM_ALIGN="wide"))
    assert out.startswith("Invalid TORCH_NEURONX_ATEN_GMM_ALIGN='wide': it is not a whole "
                          "number") and "Accepted: a whole number" in out


def test_dynamo_backend_names(tmp_path):
    out = facts(run("""
        import json, torch
        from torch_neuronx.neuron_dynamo_backend import (create_neuron_backend,
            get_model_name, get_rank, set_model_name)
        before = get_model_name()
        set_model_name("tiny")
        f = torch.compile(lambda a: a * 2, backend=create_neuron_backend())
        y = f(torch.ones(3, device="neuron"))
        try:
            set_model_name(3)
            refused = None
        except TypeError as exc:
            refused = str(exc)
        print(json.dumps([before, get_model_name(), get_rank(), y.cpu().tolist(), refused]))
        """, tmp_path))
    assert out == [None, "tiny", 0, [2.0, 2.0, 2.0], "set_model_name expects a str, got int: 3"]
