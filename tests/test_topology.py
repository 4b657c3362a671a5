import subprocess
import sys

import pytest

from neuronmp import topology
from neuronmp.errors import TopologyError


@pytest.mark.parametrize("name,chips,per", [
    ("inf1.xlarge", 1, 4), ("inf1.2xlarge", 1, 4), ("inf1.6xlarge", 4, 4),
    ("inf1.24xlarge", 16, 4), ("inf2.xlarge", 1, 2), ("inf2.8xlarge", 1, 2),
    ("inf2.24xlarge", 6, 2), ("inf2.48xlarge", 12, 2), ("trn1.2xlarge", 1, 2),
    ("trn1.32xlarge", 16, 2),
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
            "from neuronmp import topology; t = topology.parse(None); "
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
