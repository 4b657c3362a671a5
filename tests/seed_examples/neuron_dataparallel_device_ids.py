model_parallel = torch.neuron.DataParallel(model_neuron, device_ids=["nc:0"])
