"""Run the Neuron SDK pages' examples (copied verbatim into
tests/seed_examples/) exactly as written, under the
NEURONMP_PROVIDE aliases, and check each against plain torch.

    python run_seeds.py OUT.json         (also as a neuronmp-run rank: OUT gets .<RANK>)

The examples, in seed_examples/ (kept as on the pages, so ruff skips that folder),
and where they come from:

  trace_function.py, trace_module.py, dynamic_batch.py
      complete programs, copied verbatim from torch-neuronx-trace-api.txt; run as
      ``__main__`` in an empty directory, then their own variables are compared
      with the plain-torch function or module they traced.
  placement_*.py
      the code blocks of torch-neuronx-core-placement-api.rst.txt (the .html page
      has the same code), verbatim.  They assume a saved ``example_neuron_model.pt``
      and an ``example`` input: PLACEMENT_PREAMBLE makes both (the trace page's
      module example).  Checked: each ``model(example) # Executes on NeuronCore N``
      comment (in order) against round robin over the model's placement, and its
      output against torch.
  neuron_dataparallel_*.py
      torch-neuron-dataparallel-api.txt includes its examples from files the page
      does not carry; these are its usage lines (``>>>`` prompts dropped) and the
      device_ids note's ``["nc:0"]``, after NEURON_PREAMBLE (a torch.neuron.trace'd
      module).  Checked: output equal to torch on a batch DataParallel accepts.

The last line printed (and OUT.json) is {"examples": {example: "ok" | error text},
"cores": the global ids of this process's NeuronCores}.
"""
import gc
import glob
import json
import os
import re
import runpy
import sys
import tempfile
import traceback

import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seed_examples")

MODEL = '''
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 3)

    def forward(self, x):
        return self.conv(x) + 1
'''
PLACEMENT_PREAMBLE = "import torch\nimport torch_neuronx\n" + MODEL + '''
reference = Model().eval()
example = torch.rand(1, 1, 3, 3)
torch.jit.save(torch_neuronx.trace(reference, example), 'example_neuron_model.pt')
'''
NEURON_PREAMBLE = "import torch\nimport torch_neuron\n" + MODEL + '''
model = Model().eval()
image = torch.rand(1, 1, 3, 3)
model_neuron = torch.neuron.trace(model, image)
'''
EXECUTES = re.compile(r"^(\w+)\(example\)\s*# Executes on NeuronCore (\d+)", re.M)


def close(a, b):
    return torch.allclose(a, b.detach(), atol=1e-5)


def check_program(name, ns):
    if name == "trace_function":
        x, y = torch.rand(3), torch.rand(3)
        assert close(ns["loaded"](x, y), ns["func"](x, y))
        assert close(ns["trace"](x, y), ns["func"](x, y))
    elif name == "trace_module":
        x = torch.rand(1, 1, 3, 3)
        assert close(ns["loaded"](x), ns["model"](x))
        assert close(ns["trace"](x), ns["model"](x))
    elif name == "dynamic_batch":
        out = ns["ouput_batch_8"]
        assert out.shape[0] == 8 and close(out, ns["n"](ns["inputs_batch_8"]))
    else:
        raise AssertionError(f"no check for {name}")


def check_placement(source, ns):
    """Each ``var(example) # Executes on NeuronCore N`` line, in order, names the core that
    round robin over the model's placement gives that call."""
    from neuronmp.session import model as nmp_model

    calls = {}
    for var, core in EXECUTES.findall(source):
        calls.setdefault(var, []).append(int(core))
    assert calls, "the example names no core"
    for var, cores in calls.items():
        placed = nmp_model.models_in(ns[var])[0].placement
        turns = [placed[i % len(placed)] for i in range(len(cores))]
        assert turns == cores, f"{var} on nc:{list(placed)} runs on {turns}, the page says {cores}"
        assert close(ns[var](ns["example"]), ns["reference"](ns["example"]))


def check_neuron(ns):
    dp = ns["model_parallel"]
    rows = 5 if dp.dynamic_batching else len(dp.device_ids)
    batch = torch.rand(rows, 1, 3, 3)
    assert close(dp(batch), ns["model"](batch))


def run_one(path):
    name = os.path.basename(path)[:-3]
    with open(path) as f:
        source = f.read()
    if name.startswith("placement_"):
        ns = {"__name__": "__main__"}
        exec(compile(PLACEMENT_PREAMBLE, "<placement preamble>", "exec"), ns)
        gc.collect()   # the preamble's trace is gone: its core is free again
        exec(compile(source, path, "exec"), ns)
        check_placement(source, ns)
    elif name.startswith("neuron_"):
        ns = {"__name__": "__main__"}
        exec(compile(NEURON_PREAMBLE, "<torch.neuron preamble>", "exec"), ns)
        exec(compile(source, path, "exec"), ns)
        check_neuron(ns)
    else:
        ns = runpy.run_path(path, run_name="__main__")
        check_program(name, ns)
    ns.clear()
    gc.collect()   # release the example's models before the next one places its own


def main():
    results = {}
    for path in sorted(glob.glob(os.path.join(HERE, "*.py"))):
        with tempfile.TemporaryDirectory() as cwd:
            os.chdir(cwd)
            try:
                run_one(path)
                results[os.path.basename(path)] = "ok"
            except Exception:  # noqa: BLE001 - reported per example
                results[os.path.basename(path)] = traceback.format_exc(limit=4)
            finally:
                os.chdir(HERE)
    import neuronmp

    report = {"examples": results, "cores": list(neuronmp.visible_cores())}
    out = sys.argv[1] if len(sys.argv) > 1 else None
    if out:
        rank = os.environ.get("RANK")
        with open(out + (f".{rank}" if rank is not None else ""), "w") as f:
            json.dump(report, f)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
