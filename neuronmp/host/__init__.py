"""The host layer, torch-free: this process's cores and the files that guard them.

    envconfig, settings        NEURONMP_* / NEURON_RT_* variables, parsed once per runtime
    topology, visibility       the instance's cores; which of them this process sees
    paths, flock, reservation  the runtime directory and the per-core file locks
    procid, liveness,          who owns what (pid + start time), alive-or-not, and the
      leftovers                clean-up of what dead processes left
    spans, supervise           start-up timing spans; stopping child processes
    devicetime                 the modelled device time of an execution
    runtime                    init/shutdown: the process's reserved cores, its hooks
    _torchscript               neuronmp's own TorchScript calls, quiet (no torch import)

Everything above imports these modules by name; nothing here imports a layer above.
"""
