"""Every public error class: named by the root namespace, picklable with its fields.

    neuronmp/**/*.py --ast--> classes deriving from NeuronmpError (not _private)
        each one: in neuronmp.__all__, neuronmp.<name> is it, and an example of it
        survives pickle with the same type, fields and message

Errors cross process boundaries (a worker's, a rank's, a served request's), so a
new error class without fields that pickle, or one users cannot reach from
``neuronmp``, fails here.
"""
from __future__ import annotations

import ast
import pathlib
import pickle

import pytest

import neuronmp

ROOT = pathlib.Path(neuronmp.__file__).parent


def _base_names(node: ast.ClassDef):
    for base in node.bases:
        if isinstance(base, ast.Name):
            yield base.id
        elif isinstance(base, ast.Attribute):
            yield base.attr


def public_error_classes(sources=None):
    """Names of the classes defined in ``sources`` (default: the package's modules)
    that derive from NeuronmpError, directly or through another such class."""
    classes = {}
    sources = sources if sources is not None else [p.read_text() for p in ROOT.rglob("*.py")]
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = set(_base_names(node))
    errors = {"NeuronmpError"}
    while True:
        more = {n for n, bases in classes.items() if bases & errors} - errors
        if not more:
            break
        errors |= more
    return {n for n in errors if not n.startswith("_")}


#: an example of each public error, built as the code that raises it builds it
EXAMPLES = {
    "NeuronmpError": lambda e: e.NeuronmpError(),
    "ConfigError": lambda e: e.ConfigError("NEURONMP_RING_BYTES", "8MB", "it is not a byte "
                                           "count", "a number of bytes"),
    "TopologyError": lambda e: e.TopologyError("warp-9", ("inf2.xlarge", "trn1.2xlarge")),
    "VisibilityError": lambda e: e.VisibilityError("NEURON_RT_VISIBLE_CORES", "3,5",
                                                   "not contiguous", "contiguous cores"),
    "ProvideError": lambda e: e.ProvideError("NEURONMP_PROVIDE", "torch_cuda", ["torch_cuda"],
                                             ["torch_neuronx"]),
    "ProvideConflictError": lambda e: e.ProvideConflictError(
        "NEURONMP_PROVIDE", "torch_neuronx,torchneuron", ("torch_neuronx", "torchneuron")),
    "DeviceExtensionError": lambda e: e.DeviceExtensionError("a C++ compiler", "no c++"),
    "NeuronForkError": lambda e: e.NeuronForkError(1234),
    "CompileOptionError": lambda e: e.CompileOptionError("dynamic", True, "False or None"),
    "DeviceIdError": lambda e: e.DeviceIdError(9, "device id 9 is out of range"),
    "RuntimeDirError": lambda e: e.RuntimeDirError("/tmp/x", "it is writable by others"),
    "ExtensionCacheError": lambda e: e.ExtensionCacheError("/tmp/c", "owned by uid 0"),
    "UnsafeDirectoryError": lambda e: e.UnsafeDirectoryError("/tmp/bin", 0o777, 0),
    "CoreUnavailableError": lambda e: e.CoreUnavailableError((2, 3), 1, [(2, 99, "python")],
                                                             "busy"),
    "PeerDiedError": lambda e: e.PeerDiedError(99, "ring closed"),
    "ShmSpaceError": lambda e: e.ShmSpaceError("/dev/shm", 1 << 30, 1 << 20),
    "WorkerDiedError": lambda e: e.WorkerDiedError(1, 99, -9),
    "WorkerPackageError": lambda e: e.WorkerPackageError(0, "/a/neuronmp", "/b/neuronmp"),
    "ExecTimeoutError": lambda e: e.ExecTimeoutError(0, 3, 30.0),
    "WeightWriteError": lambda e: e.WeightWriteError(0, 3, "Net", ["fc.weight"]),
    "BatchBucketsError": lambda e: e.BatchBucketsError([4, 2], "is not increasing"),
    "ModelError": lambda e: e.ModelError(0, "RuntimeError", "ValueError: boom", "Trace..."),
    "PoolClosedError": lambda e: e.PoolClosedError(),
    "QueueFullError": lambda e: e.QueueFullError(8, 8, 1),
    "RequestTimeoutError": lambda e: e.RequestTimeoutError(0.5, "running"),
    "ServerClosedError": lambda e: e.ServerClosedError(),
    "MonitorConfigError": lambda e: e.MonitorConfigError("m.json", "period", "x",
                                                         "not a period", "'5s'"),
    "CollectiveRankDiedError": lambda e: e.CollectiveRankDiedError(1, 99, "all_reduce"),
    "CollectiveTimeoutError": lambda e: e.CollectiveTimeoutError("barrier", [1], 5.0),
    "CollectiveUsageError": lambda e: e.CollectiveUsageError("all_to_all", "uneven splits"),
    "CollectiveOpError": lambda e: e.CollectiveOpError(
        "all_reduce", "tensors cannot be empty, found empty tensors at indices: [0]"),
    "CollectiveMismatchError": lambda e: e.CollectiveMismatchError(
        "all_reduce", [{"op": "all_reduce", "numel": 4, "dtype": "float32"},
                       {"op": "broadcast", "numel": 4, "dtype": "float32", "root": 0}], [1]),
    "ModelConfigError": lambda e: e.ModelConfigError("m/config.pbtxt", "max_batch_size", -1,
                                                     "a whole number >= 0"),
    "InferRequestError": lambda e: e.InferRequestError("x", "shape [2] does not match"),
    "SharedMemoryError": lambda e: e.SharedMemoryError("r", "is not registered"),
}


def test_the_examples_cover_every_public_error_class():
    assert set(EXAMPLES) == public_error_classes()


def test_the_discovery_sees_an_error_derived_in_two_steps_and_skips_private_ones():
    planted = ("class NeuronmpError(Exception): pass\n"
               "class ConfigError(NeuronmpError, ValueError): pass\n"
               "class A(errors.ConfigError): pass\nclass B(A): pass\n"
               "class _C(A): pass\nclass D(ValueError): pass\n")
    assert public_error_classes([planted]) == {"NeuronmpError", "ConfigError", "A", "B"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_public_error_is_in_the_root_namespace_and_pickles_with_its_fields(name):
    assert name in neuronmp.__all__
    cls = getattr(neuronmp, name)
    assert cls.__name__ == name and issubclass(cls, neuronmp.NeuronmpError)
    exc = EXAMPLES[name](neuronmp)
    assert type(exc) is cls
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc)
    for field in cls._fields:
        assert getattr(back, field) == getattr(exc, field), field
