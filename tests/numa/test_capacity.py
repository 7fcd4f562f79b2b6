"""Per-node budgets and refusals on fake 2- and 4-socket machines."""

from __future__ import annotations

import pytest

from bigmem.config import resolve_config
from bigmem.errors import InsufficientMemoryError
from bigmem.memory.estimate import NetworkCounts
from bigmem.memory.search import make_plan
from bigmem.memory.records import Budget
from bigmem.nets.unet3d import UNet3D
from bigmem.numa.capacity import check_nodes_fit, placement_budget
from bigmem.numa.policy import resolve_placement
from bigmem.numa.topology import NUMATopology

GIB = 2**30


def _placement(root, text):
    topology = NUMATopology.from_sysfs(root)
    return resolve_placement(text, None, None, topology, {c for n in topology.nodes for c in n.cpus}), topology


def test_bind_budget_is_the_bound_nodes_free_memory(two_socket):
    placement, topology = _placement(two_socket, "bind:1")
    assert placement_budget(placement, topology, 1000 * GIB) == (384 * GIB, "free memory of node(s) 1")
    placement, topology = _placement(two_socket, "bind:0-1")
    assert placement_budget(placement, topology, 1000 * GIB)[0] == (700 + 384) * GIB


def test_interleave_budget_is_limited_by_the_fullest_node(four_socket):
    placement, topology = _placement(four_socket, "interleave")
    budget, source = placement_budget(placement, topology, 1400 * GIB)
    assert budget == 4 * 40 * GIB
    assert source == "4 interleaved node(s) x the smallest free 40.00 GiB"
    placement, topology = _placement(four_socket, "interleave:0-2")
    assert placement_budget(placement, topology, 0)[0] == 3 * 370 * GIB


def test_other_policies_use_the_machine(four_socket):
    for text in ("none", "local", "preferred:3"):
        placement, topology = _placement(four_socket, text)
        assert placement_budget(placement, topology, 123) == (123, "MemAvailable")


def test_interleave_refusal_names_the_node(four_socket):
    placement, topology = _placement(four_socket, "interleave")
    check_nodes_fit(150 * GIB, placement, topology)  # 37.5 GiB per node fits even node 3
    with pytest.raises(InsufficientMemoryError) as info:
        check_nodes_fit(400 * GIB, placement, topology)
    assert str(info.value) == ("Predicted peak 400.00 GiB interleaved over 4 node(s) needs 100.00 GiB on each; "
                               "node 3 has 40.00 GiB (node 0: 370.00 GiB free, node 1: 370.00 GiB free, node 2: "
                               "370.00 GiB free, node 3: 40.00 GiB free).")
    assert info.value.exit_code == 3
    assert info.value.available_bytes == 160 * GIB


def test_bind_refusal_gives_the_per_node_figures(two_socket):
    placement, topology = _placement(two_socket, "bind:1")
    with pytest.raises(InsufficientMemoryError) as info:
        check_nodes_fit(500 * GIB, placement, topology)
    assert str(info.value) == ("Predicted peak 500.00 GiB does not fit numa.policy bind:1 (node 1: 384.00 GiB free; "
                               "384.00 GiB in all). Bind more nodes, or use numa.policy interleave.")


def test_planner_refuses_per_node(four_socket):
    """kits19 at 512^3, batch 2, on a 4-socket machine: interleaving is capped by the fullest node."""
    placement, topology = _placement(four_socket, "interleave")
    budget, source = placement_budget(placement, topology, 1400 * GIB)
    config = resolve_config("kits19")
    model = UNet3D(config.model).build_for()
    counts_for = lambda shape: NetworkCounts.from_model(model, shape)  # noqa: E731
    plan = make_plan(config, counts_for, Budget(budget, source), volume=512, batch_size=2)
    assert not plan.fits  # 4 x 40 GiB cannot hold two whole 512^3 kits19 volumes in any mode
    assert plan.closest.predicted_peak_bytes > budget
    with pytest.raises(InsufficientMemoryError, match=r"node 3 has 40\.00 GiB"):
        check_nodes_fit(plan.closest.predicted_peak_bytes, placement, topology)
    # Without node 3, interleaving over the other three fits it.
    placement3, _ = _placement(four_socket, "interleave:0-2")
    budget3, source3 = placement_budget(placement3, topology, 1400 * GIB)
    assert make_plan(config, counts_for, Budget(budget3, source3), volume=512, batch_size=2).fits
