model_parallel = torch.neuron.DataParallel(model_neuron)
