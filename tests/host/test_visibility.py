import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronmp.errors import DeviceIdError, VisibilityError
from neuronmp.host import topology, visibility

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
    assert [tuple(b) for b in blocks] == [(0, 1, 2), (1, 2, 3), (2, 3, 4)]
    assert [tuple(b) for b in visibility.candidate_blocks(visibility.Request(), 3)] == [(0, 1, 2)]
    explicit = visibility.candidate_blocks(visibility.Request(cores=(4, 5, 6)), 16)
    assert [tuple(b) for b in explicit] == [(4, 5, 6)]


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
from neuronmp.host import visibility
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
    code = ("import sys, time; t = time.perf_counter(); import neuronmp, neuronmp.host.topology, "
            "neuronmp.host.visibility; neuronmp.visible_cores(); "
            "print('torch' in sys.modules, time.perf_counter() - t)")
    out = procs.python(code).communicate(timeout=60)[0].split()
    assert out[0] == "False"


# -- bad input caught before it costs anything ---------------------

_HUGE_RANGES = r"""
import resource, sys
# 256 MiB of address space: materialising 0-50000000 needs about 2 GB
resource.setrlimit(resource.RLIMIT_AS, (256 << 20, 256 << 20))
from neuronmp.host import visibility
from neuronmp.errors import VisibilityError
for value in sys.argv[1:]:
    try:
        visibility.parse_visible_cores(value, 16)
    except VisibilityError as exc:
        print("refused", "beyond this host's 16 cores" in str(exc), flush=True)
"""


def test_huge_core_ranges_are_refused_before_any_list_is_built(procs):
    values = ["0-50000000", "0-99999999999", "3-" + "9" * 5000, "9" * 5000]
    p = procs.popen([sys.executable, "-c", _HUGE_RANGES, *values], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split("\n")[:-1] == ["refused True"] * len(values)


@pytest.mark.parametrize("value", ["0-99999999999", "5-" + "9" * 5000, "0-65536"])
def test_huge_ranges_named_in_process(value):
    with pytest.raises(VisibilityError, match="beyond") as info:
        visibility.parse_visible_cores(value, None if value == "0-65536" else 16)
    assert len(str(info.value)) < 600  # the value is quoted by its start only


@pytest.mark.parametrize("value", ["\u0663", "1-\u0663", "\u00b2", "\uff11"])
def test_visible_cores_take_ascii_digits_only(value):
    with pytest.raises(VisibilityError, match="not a core index"):
        visibility.parse_visible_cores(value, 16)


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1_0", "9" * 5000])
def test_num_cores_take_ascii_digits_only(value):
    with pytest.raises(VisibilityError) as info:
        visibility.parse_num_cores(value, 16)
    assert info.value.variable == "NEURON_RT_NUM_CORES"


@pytest.mark.parametrize("rank,size", [("\u00b2", "4"), ("0", "\u00b2"), ("0", "9" * 5000),
                                       ("1_0", "20")])
def test_torchrun_rank_variables_take_ascii_digits_only(rank, size):
    env = {"LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": size}
    with pytest.raises(VisibilityError) as info:
        visibility.torchrun_share(TOPO16, env)
    assert info.value.variable in env


@pytest.mark.parametrize("bad", ["nc:\u0663", "nc:\u00b2"])
def test_device_ids_take_ascii_digits_only(bad):
    with pytest.raises(DeviceIdError):
        visibility.parse_device_id(bad)


def test_huge_device_index_is_out_of_range_not_a_crash():
    with pytest.raises(DeviceIdError, match="out of range"):
        visibility.local_to_global("nc:" + "9" * 5000, (0, 1))


# -- the one core-span formatter ----------------------------------------------------------


def test_span_forms():
    span = visibility.span
    assert span((3, 4, 5)) == "3-5" and span((3, 4, 5), "nc") == "nc3-nc5"
    assert span((3,)) == "3" and span((3,), "nc") == "nc3"
    assert span((1,), "nc", pair=True) == "nc1-nc1"
    assert span((0, 1, 2, 6, 8, 9), "nc") == "nc0-nc2,nc6,nc8-nc9"
    assert span(()) == "none" and span((), none="") == ""
    assert span(range(4096)) == "0-4095"
    # what it writes, the visibility grammar reads back
    for cores in ((7,), (0, 1, 2), tuple(range(5, 16))):
        assert visibility.parse_visible_cores(span(cores), 16) == cores


def test_refusal_message_spans_requested_cores_as_the_runtime_does():
    from neuronmp.errors import CoreUnavailableError

    assert str(CoreUnavailableError((1,), 0)).startswith(
        "NeuronCore(s) not available - Requested:nc1-nc1 Available:0")
    assert "Requested:nc4-nc7 " in str(CoreUnavailableError((4, 5, 6, 7), 12))
    assert "Requested:none " in str(CoreUnavailableError((), 12))


# -- the grammar, by property ----------------------------------------------------------------

_GRAMMAR = st.lists(st.sampled_from(list("0123456789-, \t") + ["\u00b2", "\u0663",
                                                                  "99999999999", "9" * 5000]),
                    max_size=20).map("".join)


@settings(max_examples=400, deadline=None)
@given(_GRAMMAR | st.text(max_size=30))
def test_any_value_gives_contiguous_cores_on_the_host_or_a_named_refusal(value):
    try:
        cores = visibility.parse_visible_cores(value, 16)
    except VisibilityError as exc:
        assert exc.variable == "NEURON_RT_VISIBLE_CORES" and "Accepted:" in str(exc)
        return
    assert cores and list(cores) == list(range(cores[0], cores[-1] + 1)) and cores[-1] < 16


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4095), st.integers(1, 4096), st.integers(1, 8))
def test_spans_read_back_and_split_anywhere(first, length, pieces):
    cores = tuple(range(first, min(first + length, 4096)))
    assert visibility.parse_visible_cores(visibility.span(cores), 4096) == cores
    # the same cores written as several adjacent comma entries read back the same
    cut = sorted({cores[0]} | {cores[(i * len(cores)) // pieces] for i in range(pieces)})
    entries = [visibility.span(tuple(c for c in cores if a <= c < b))
               for a, b in zip(cut, cut[1:] + [cores[-1] + 1])]
    assert visibility.parse_visible_cores(",".join(entries), 4096) == cores
