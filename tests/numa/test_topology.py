"""Topology read from (fake and real) sysfs."""

from __future__ import annotations

import pytest

from bigmem.errors import DataError
from bigmem.numa.topology import NUMATopology, parse_cpulist

GIB = 2**30


def test_two_socket(two_socket):
    topology = NUMATopology.from_sysfs(two_socket)
    assert topology.num_nodes == 2
    assert topology.node(1).cpus == tuple(range(24, 48)) + tuple(range(72, 96))
    assert topology.node(0).total_bytes == 768 * GIB
    assert topology.node(1).free_bytes == 384 * GIB
    assert topology.node(1).distances == (21, 10)
    assert topology.total_bytes == 1536 * GIB


def test_four_socket(four_socket):
    topology = NUMATopology.from_sysfs(four_socket)
    assert [n.node_id for n in topology.nodes] == [0, 1, 2, 3]
    assert sum(len(n.cpus) for n in topology.nodes) == 80
    assert topology.to_dict()["nodes"][3] == {"node": 3, "cpus": list(range(60, 80)), "total_bytes": 384 * GIB,
                                              "free_bytes": 40 * GIB, "distances": [21, 21, 21, 10]}


def test_no_sysfs_is_one_node(tmp_path):
    topology = NUMATopology.from_sysfs(tmp_path)
    assert topology.num_nodes == 1
    assert topology.source.startswith("psutil")
    assert topology.node(0).total_bytes > 0


def test_real_machine_has_node_zero():
    topology = NUMATopology.from_sysfs()
    assert topology.node(0).cpus
    assert topology.node(0).total_bytes > 0


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)), ("5", (5,)), ("", ()),
                                        ("2,0-1\n", (0, 1, 2))])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


def test_parse_cpulist_rejects():
    with pytest.raises(DataError, match=r"^Cannot parse CPU list '1-x': expected a list such as 0-3,8,10-11\.$"):
        parse_cpulist("1-x")
