model_parallel = torch.neuron.DataParallel(model_neuron)
model_parallel.disable_dynamic_batching()
