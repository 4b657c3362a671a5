with torch_neuronx.experimental.multicore_context():
    model = torch.jit.load('example_neuron_model.pt')

model(example) # Executes on NeuronCore 0
model(example) # Executes on NeuronCore 1
model(example) # Executes on NeuronCore 2
