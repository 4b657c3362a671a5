"""The session and the request path: a runtime's pool and the calls that reach it.

    coreuse    the core book: how many models use each visible core
    session    the one owner of a runtime's pool and its loaded models
    pytree     nested inputs and outputs flattened to tensors and back
    sdkargs    the Neuron SDK's keyword arguments, checked
    chunking   DataParallel's batch cuts (with _rowcut, the C row cutter)
    model      a loaded model: placement, calls, answers

The SDK API (neuronmp.tracing, .parallel, .placement ...) sits above and imports
these modules by name.
"""
