import torch
import torch_neuronx

def func(x, y):
    return 2 * x + y

example_inputs = torch.rand(3), torch.rand(3)

# Runs `func` with the provided inputs and records the tensor operations
trace = torch.neuronx.trace(func, example_inputs)

# `trace` can now be run with the TorchScript interpreter or saved
# and loaded in a Python-free environment
torch.jit.save(trace, 'func.pt')

# Executes on a NeuronCore
loaded = torch.jit.load('func.pt')
loaded(torch.rand(3), torch.rand(3))
