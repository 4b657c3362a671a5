import json

import pytest

from neuronmp import topology, visibility
from neuronmp.errors import DeviceIdError, VisibilityError

TOPO16 = topology.parse("inf1.6xlarge", cpus=[0, 1])


@pytest.mark.parametrize("value,cores", [
    ("3", (3,)), ("0-6", tuple(range(7))), ("2,3", (2, 3)), ("3-5,6", (3, 4, 5, 6)),
    ("3,4,5,6", (3, 4, 5, 6)), (" 1 - 2 , 3 ", (1, 2, 3)), ("15", (15,)), ("4-4", (4,)),
])
def test_visible_cores_grammar_accepted(value, cores):
    assert visibility.parse_visible_cores(value, 16) == cores


@pytest.mark.parametrize("value,why", [
    ("3,5,6", "not contiguous"),
    ("", "empty"),
    ("1,,2", "empty entry"),
    ("-1", "not a core index"),
    ("5-3", "reversed"),
    ("1-3,2-4", "overlaps"),
    ("3,2", "overlaps or comes before"),
    ("a", "not a core index"),
    ("1.5", "not a core index"),
    ("nc:1", "not a core index"),
    ("16", "beyond this host's 16 cores"),
    ("10-20", "beyond"),
])
def test_visible_cores_grammar_refused(value, why):
    with pytest.raises(VisibilityError) as info:
        visibility.parse_visible_cores(value, 16)
    msg = str(info.value)
    assert f"NEURON_RT_VISIBLE_CORES={value!r}" in msg
    assert why in msg
    assert "Accepted:" in msg and "'3-5,6'" in msg and "16 cores (0-15)" in msg


@pytest.mark.parametrize("value,count", [("0", 0), ("3", 3), (" 16 ", 16)])
def test_num_cores_accepted(value, count):
    assert visibility.parse_num_cores(value, 16) == count


@pytest.mark.parametrize("value,why", [("-1", "whole number"), ("x", "whole number"),
                                       ("17", "only 16 cores"), ("2.0", "whole number")])
def test_num_cores_refused(value, why):
    with pytest.raises(VisibilityError, match=why) as info:
        visibility.parse_num_cores(value, 16)
    assert f"NEURON_RT_NUM_CORES={value!r}" in str(info.value)


def test_request_forms():
    req = visibility.request_from_env
    assert req(TOPO16, {}) == visibility.Request()
    assert req(TOPO16, {"NEURON_RT_NUM_CORES": "0"}) == visibility.Request()
    assert req(TOPO16, {"NEURON_RT_NUM_CORES": "3"}).count == 3
    both = req(TOPO16, {"NEURON_RT_NUM_CORES": "3", "NEURON_RT_VISIBLE_CORES": "4-5"})
    assert both.cores == (4, 5) and both.count is None


def test_candidate_blocks_are_contiguous_and_in_order():
    blocks = visibility.candidate_blocks(visibility.Request(count=3), 5)
    assert blocks == [(0, 1, 2), (1, 2, 3), (2, 3, 4)]
    assert visibility.candidate_blocks(visibility.Request(), 3) == [(0, 1, 2)]


def test_device_ids():
    vis = (7, 8, 9)
    assert visibility.local_to_global(0, vis) == 7
    assert visibility.local_to_global("nc:2", vis) == 9
    assert visibility.global_to_local(8, vis) == 1
    for bad in (1.0, "1", "nc:x", "nc:-1", None, True, [0]):
        with pytest.raises(DeviceIdError, match="Expected `nc:#` or an integer, but got: "):
            visibility.parse_device_id(bad)
    with pytest.raises(DeviceIdError, match=r"sees 3 NeuronCore\(s\), nc:0-nc:2"):
        visibility.local_to_global("nc:3", vis)
    with pytest.raises(DeviceIdError, match="not visible"):
        visibility.global_to_local(3, vis)


_SDK_EXAMPLE = """
import json, neuronmp
from neuronmp import visibility
vis = neuronmp.visible_cores()
out = {"visible": list(vis), "count": neuronmp.core_count()}
for probe in ("nc:0", "nc:7", "nc:14", 6):
    try:
        out[str(probe)] = visibility.local_to_global(probe, vis)
    except ValueError as exc:
        out[str(probe)] = "refused: " + str(exc)
print(json.dumps(out))
"""


def test_sdk_example_two_processes_split_inf1_6xlarge(procs):
    env = {"NEURONMP_TOPOLOGY": "inf1.6xlarge"}
    first = procs.python(_SDK_EXAMPLE, env={**env, "NEURON_RT_VISIBLE_CORES": "0-6"})
    second = procs.python(_SDK_EXAMPLE, env={**env, "NEURON_RT_VISIBLE_CORES": "7-15"})
    a, b = (json.loads(p.communicate(timeout=60)[0]) for p in (first, second))
    assert a["visible"] == list(range(7)) and a["count"] == 7
    assert b["visible"] == list(range(7, 16)) and b["count"] == 9
    assert b["nc:0"] == 7 and b["nc:7"] == 14 and b["6"] == 13
    assert a["nc:0"] == 0 and a["6"] == 6
    assert a["nc:14"].startswith("refused") and "sees 7 NeuronCore(s)" in a["nc:14"]


def test_import_is_cheap_and_torch_free(procs):
    code = ("import sys, time; t = time.perf_counter(); import neuronmp, neuronmp.topology, "
            "neuronmp.visibility; neuronmp.visible_cores(); "
            "print('torch' in sys.modules, time.perf_counter() - t)")
    out = procs.python(code).communicate(timeout=60)[0].split()
    assert out[0] == "False"
