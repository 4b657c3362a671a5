import json
import subprocess
import sys

import pytest

from neuronmp.errors import ConfigError, TopologyError, VisibilityError
from neuronmp.host import topology, visibility


@pytest.mark.parametrize("name,chips,per", [
    ("inf1.xlarge", 1, 4), ("inf1.2xlarge", 1, 4), ("inf1.6xlarge", 4, 4),
    ("inf1.24xlarge", 16, 4), ("inf2.xlarge", 1, 2), ("inf2.8xlarge", 1, 2),
    ("inf2.24xlarge", 6, 2), ("inf2.48xlarge", 12, 2), ("trn1.2xlarge", 1, 2),
    ("trn1.32xlarge", 16, 2), ("trn2.3xlarge", 1, 4), ("trn2.48xlarge", 16, 4),
])
def test_presets_have_real_core_counts(name, chips, per):
    topo = topology.parse(name, cpus=range(8))
    assert (topo.chips, topo.cores_per_chip, topo.num_cores) == (chips, per, chips * per)
    assert topo.chip_of(topo.num_cores - 1) == chips - 1


def test_grid_form_and_chip_grouping():
    topo = topology.parse("4x4", cpus=[0, 1])
    assert topo.name == "4x4" and topo.num_cores == 16
    assert [topo.chip_of(c) for c in (0, 3, 4, 15)] == [0, 0, 1, 3]


@pytest.mark.parametrize("bad", ["inf9.huge", "4x", "x4", "0x4", "4x0", "4*4", "2x2x2", "-1x4"])
def test_unknown_topology_lists_valid_names(bad):
    with pytest.raises(TopologyError) as info:
        topology.parse(bad, cpus=[0])
    msg = str(info.value)
    assert repr(bad) in msg and "inf1.6xlarge" in msg and "CHIPSxCORES" in msg


def test_unset_means_one_core_per_available_cpu():
    topo = topology.parse(None, cpus=[2, 3, 5])
    assert topo.num_cores == 3
    assert topo.core_cpus == ((2,), (3,), (5,))


def test_unset_follows_process_affinity():
    code = ("import os; os.sched_setaffinity(0, {0}); "
            "from neuronmp.host import topology; t = topology.parse(None); "
            "print(t.num_cores, t.core_cpus)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(None, 1)
    assert out[0] == "1" and out[1].strip() == "((0,),)"


def test_cpu_map_fewer_cores_than_cpus_gives_contiguous_shares():
    assert topology.map_cpus(2, range(8)) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topology.map_cpus(2, range(5)) == ((0, 1), (2, 3, 4))


def test_cpu_map_equal():
    assert topology.map_cpus(4, [4, 5, 6, 7]) == ((4,), (5,), (6,), (7,))


def test_cpu_map_more_cores_than_cpus_wraps():
    assert topology.map_cpus(5, [0, 1]) == ((0,), (1,), (0,), (1,), (0,))
    topo = topology.parse("inf1.6xlarge", cpus=[0, 1])
    assert topo.cpus_of(14) == (0,) and topo.cpus_of(15) == (1,)


def test_cpus_of_refuses_foreign_core():
    topo = topology.parse("2x2", cpus=[0])
    with pytest.raises(IndexError, match="cores 0-3"):
        topo.cpus_of(4)


def test_from_env(emulated):
    assert emulated("trn1.32xlarge").num_cores == 32


# -- trn2 and logical NeuronCores -------------------------------------------------------


@pytest.mark.parametrize("name,lnc,logical,physical,per_chip", [
    ("trn2.48xlarge", None, 64, 128, 4), ("trn2.48xlarge", "2", 64, 128, 4),
    ("trn2.48xlarge", "1", 128, 128, 8), ("trn2.3xlarge", None, 4, 8, 4),
    ("trn2.3xlarge", " 1 ", 8, 8, 8), ("trn1.32xlarge", "1", 32, 32, 2),
    ("inf2.48xlarge", None, 24, 24, 2), ("4x4", "2", 8, 16, 2), ("4x4", None, 16, 16, 4),
])
def test_logical_core_config_sets_what_the_runtime_shows(name, lnc, logical, physical,
                                                          per_chip):
    topo = topology.parse(name, cpus=[0, 1], lnc=lnc)
    assert (topo.num_cores, topo.num_physical_cores, topo.cores_per_chip) == \
        (logical, physical, per_chip)
    assert topo.physical_cores_per_chip == physical // topo.chips
    assert len(topo.core_cpus) == logical  # one worker (CPU share) per logical core


def test_physical_cores_group_under_logical_ones():
    topo = topology.parse("trn2.48xlarge", cpus=range(4))
    assert topo.lnc == 2 and topo.lnc_choices == (2, 1)
    assert topo.physical_cores_of(0) == (0, 1) and topo.physical_cores_of(63) == (126, 127)
    assert topo.cores_of_chip(1) == (4, 5, 6, 7) and topo.chip_of(7) == 1
    grouped = [p for core in topo.cores_of_chip(1) for p in topo.physical_cores_of(core)]
    assert grouped == list(range(8, 16))  # chip 1's eight NeuronCore-v3
    flat = topology.parse("trn2.48xlarge", cpus=range(4), lnc="1")
    assert flat.physical_cores_of(9) == (9,) and flat.cores_of_chip(1) == tuple(range(8, 16))
    with pytest.raises(IndexError, match="chips 0-15"):
        topo.cores_of_chip(16)


@pytest.mark.parametrize("name", ["trn1.2xlarge", "trn1.32xlarge", "inf2.xlarge",
                                  "inf2.48xlarge", "inf1.6xlarge", "3x3"])
def test_lnc_2_refused_where_unsupported(name):
    with pytest.raises(ConfigError) as info:
        topology.parse(name, cpus=[0], lnc="2")
    err = info.value
    assert (err.variable, err.value) == ("NEURON_LOGICAL_NC_CONFIG", "2")
    assert f"1 on {name}" in err.accepted
    assert "NEURON_LOGICAL_NC_CONFIG='2'" in str(err) and name in str(err)


@pytest.mark.parametrize("bad", ["0", "3", "4", "two", "-1", "1.5"])
def test_bad_lnc_values_name_what_is_accepted(bad):
    with pytest.raises(ConfigError) as info:
        topology.parse("trn2.48xlarge", cpus=[0], lnc=bad)
    msg = str(info.value)
    assert f"NEURON_LOGICAL_NC_CONFIG={bad!r}" in msg and "1 or 2 on trn2.48xlarge" in msg


def test_from_env_reads_lnc():
    env = {"NEURONMP_TOPOLOGY": "trn2.48xlarge", "NEURON_LOGICAL_NC_CONFIG": "1"}
    assert topology.from_env(env).num_cores == 128
    assert topology.from_env({"NEURONMP_TOPOLOGY": "trn2.48xlarge"}).num_cores == 64


def test_visibility_counts_logical_cores():
    topo = topology.parse("trn2.48xlarge", cpus=[0])
    assert visibility.request_from_env(topo, {"NEURON_RT_VISIBLE_CORES": "60-63"}).cores == \
        (60, 61, 62, 63)
    with pytest.raises(VisibilityError, match="64 cores"):
        visibility.request_from_env(topo, {"NEURON_RT_VISIBLE_CORES": "64"})


def test_device_links_follow_the_instances():
    trn2 = topology.parse("trn2.48xlarge", cpus=[0])
    # the 4x4 torus as neuron-ls lists it: up, left, down, right, wrapping around
    assert trn2.connected_to(0) == (12, 3, 4, 1)
    assert trn2.connected_to(5) == (1, 4, 9, 6)
    assert trn2.connected_to(15) == (11, 14, 3, 12)
    assert topology.parse("trn2.3xlarge", cpus=[0]).connected_to(0) is None
    inf2 = topology.parse("inf2.48xlarge", cpus=[0])
    assert inf2.connected_to(0) == (11, 1) and inf2.connected_to(11) == (10, 0)
    inf1 = topology.parse("inf1.6xlarge", cpus=[0])
    assert [inf1.connected_to(c) for c in range(4)] == [(1,), (2, 0), (3, 1), (2,)]
    assert topology.parse("2x2", cpus=[0]).connected_to(1) == (0,)


def test_runtime_in_a_fresh_process_sees_logical_cores(procs):
    code = ("import json, neuronmp; from neuronmp.host import runtime; rt = runtime.init(); "
            "print(json.dumps([list(rt.cores), rt.topology.num_cores]))")
    for lnc, visible, expected in [("1", "120-127", [list(range(120, 128)), 128]),
                                   (None, "62-63", [[62, 63], 64])]:
        env = {"NEURONMP_TOPOLOGY": "trn2.48xlarge", "NEURON_RT_VISIBLE_CORES": visible}
        if lnc:
            env["NEURON_LOGICAL_NC_CONFIG"] = lnc
        p = procs.python(code, env=env)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert json.loads(out) == expected
    p = procs.python(code, env={"NEURONMP_TOPOLOGY": "inf2.xlarge",
                                "NEURON_LOGICAL_NC_CONFIG": "2"})
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "NEURON_LOGICAL_NC_CONFIG='2'" in err
