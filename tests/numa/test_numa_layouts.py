"""Interleave vs one worker per node on fake 2- and 4-node machines (``numa.layouts``)."""

from __future__ import annotations

import pytest

from bigmem.numa.layouts import evaluate_layouts
from bigmem.numa.topology import NUMATopology
from helpers import make_sysfs

GIB = 2**30


@pytest.fixture
def two_node(tmp_path):
    """2 sockets x 24 cores, 768 GiB each; 700 and 384 GiB free."""
    return NUMATopology.from_sysfs(make_sysfs(tmp_path, [("0-23", 768, 700), ("24-47", 768, 384)],
                                              [[10, 21], [21, 10]]))


@pytest.fixture
def four_node(tmp_path):
    """2 sockets with CPUs (100 and 90 GiB free) and 2 memory-only nodes (CXL expanders, 200 GiB free each)."""
    return NUMATopology.from_sysfs(make_sysfs(
        tmp_path, [("0-7", 128, 100), ("8-15", 128, 90), ("", 256, 200), ("", 256, 200)],
        [[10, 21, 14, 24], [21, 10, 24, 14], [14, 24, 10, 26], [24, 14, 26, 10]]))


def test_one_node_has_no_layouts(tmp_path):
    topology = NUMATopology.from_sysfs(make_sysfs(tmp_path, [("0-1", 24, 20)], [[10]]))
    assert evaluate_layouts(GIB, 1, topology) is None


def test_a_small_job_fits_both_and_per_node_is_recommended(two_node):
    layouts = evaluate_layouts(50 * GIB, 2, two_node)
    assert layouts.interleave.fits
    assert layouts.per_node.fits
    assert layouts.recommended == "per-node"
    assert (layouts.interleave.num_processes, layouts.interleave.global_batch_size) == (1, 2)
    assert (layouts.per_node.num_processes, layouts.per_node.global_batch_size) == (2, 4)
    assert [n.required_bytes for n in layouts.interleave.nodes] == [25 * GIB, 25 * GIB]
    assert [n.required_bytes for n in layouts.per_node.nodes] == [50 * GIB, 50 * GIB]  # each its whole peak
    assert layouts.interleave.budget_bytes == 2 * 384 * GIB
    assert layouts.per_node.budget_bytes == 384 * GIB
    assert layouts.per_node.reason == "2 workers x 50.00 GiB, each within its own node's free memory"


def test_batch_1_above_a_node_fits_only_interleaved_and_names_the_node(two_node):
    layouts = evaluate_layouts(500 * GIB, 1, two_node)  # more than node 1's 384 GiB, within 2 x 384
    assert layouts.interleave.fits
    assert not layouts.per_node.fits
    assert layouts.recommended == "interleave"
    assert layouts.per_node.reason == "each worker needs 500.00 GiB on its own node; node 1 has 384.00 GiB free"
    assert [n.fits for n in layouts.per_node.nodes] == [True, False]


def test_neither_fits_and_interleave_names_its_fullest_node(two_node):
    layouts = evaluate_layouts(800 * GIB, 1, two_node)
    assert not layouts.interleave.fits
    assert not layouts.per_node.fits
    assert layouts.recommended is None
    assert layouts.interleave.reason == ("800.00 GiB over 2 nodes puts 400.00 GiB on each; node 1 has "
                                         "384.00 GiB free")


def test_memory_only_nodes_carry_no_worker(four_node):
    layouts = evaluate_layouts(60 * GIB, 1, four_node)
    per_node = layouts.per_node
    assert per_node.num_processes == 2
    assert per_node.global_batch_size == 2
    assert [(n.node_id, n.worker, n.required_bytes) for n in per_node.nodes] == [
        (0, True, 60 * GIB), (1, True, 60 * GIB), (2, False, 0), (3, False, 0)]
    assert per_node.fits
    assert per_node.budget_bytes == 90 * GIB
    assert per_node.reason.endswith("; node(s) 2,3 have no CPUs and carry no worker")
    assert layouts.interleave.budget_bytes == 4 * 90 * GIB  # interleave spreads over the memory-only nodes too


def test_four_nodes_batch_1_above_a_socket_interleaves(four_node):
    layouts = evaluate_layouts(300 * GIB, 1, four_node)  # 75 GiB on each of 4 nodes; no socket holds 300
    assert layouts.interleave.fits
    assert not layouts.per_node.fits
    assert layouts.recommended == "interleave"
    assert "node 1 has 90.00 GiB free" in layouts.per_node.reason


def test_to_dict_is_plan_json_layouts(four_node):
    data = evaluate_layouts(300 * GIB, 1, four_node).to_dict()
    assert data["recommended"] == "interleave"
    assert data["topology_source"].endswith("sys/devices/system/node")
    assert set(data["interleave"]) == {"layout", "num_processes", "batch_size", "global_batch_size",
                                       "predicted_peak_bytes", "budget_bytes", "fits", "reason", "nodes"}
    assert data["per_node"]["nodes"][2] == {"node": 2, "free_bytes": 200 * GIB, "required_bytes": 0,
                                            "worker": False, "fits": True}
    assert (data["per_node"]["num_processes"], data["per_node"]["fits"]) == (2, False)
