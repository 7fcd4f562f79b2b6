"""``memory.plans``: the planning API's own rules (plan_job, plan_search and plan_inference are also tested in
test_budget.py, test_search.py and test_inference.py)."""

from __future__ import annotations

from bigmem.memory.budget import Budget
from bigmem.memory.plans import planned_shape, search_budget
from bigmem.numa.topology import NUMANode, NUMATopology

GIB = 2**30


def _nodes(*free_gib: int, memory_only: int = 0) -> NUMATopology:
    nodes = [NUMANode(i, (i,), 64 * GIB, free * GIB, ()) for i, free in enumerate(free_gib)]
    nodes += [NUMANode(len(nodes) + i, (), 64 * GIB, 10 * GIB, ()) for i in range(memory_only)]
    return NUMATopology(tuple(nodes), "fake")


def test_memavailable_on_several_nodes_becomes_what_one_interleaved_process_holds():
    sized = search_budget(Budget(9 * GIB, "MemAvailable"), _nodes(5, 2, 2))
    assert sized.budget_bytes == 6 * GIB
    assert sized.source == "3 interleaved node(s) x the smallest free 2.00 GiB"


def test_memory_only_nodes_count_for_interleave():
    assert search_budget(Budget(40 * GIB, "MemAvailable"), _nodes(20, 20, memory_only=1)).budget_bytes == 30 * GIB


def test_an_explicit_or_placed_budget_is_kept():
    given = Budget(9 * GIB, "--memory-budget")
    assert search_budget(given, _nodes(5, 2)) is given
    placed = Budget(2 * GIB, "free memory of node(s) 1")
    assert search_budget(placed, _nodes(5, 2)) is placed


def test_one_node_keeps_memavailable():
    available = Budget(9 * GIB, "MemAvailable")
    assert search_budget(available, _nodes(9)) is available
    assert search_budget(available, None) is available


def test_planned_shape_is_the_largest_case_alone_or_the_bounding_shape_of_a_batch():
    shapes = [(33, 34, 35), (64, 16, 16), (16, 64, 17)]
    assert planned_shape(shapes, 1) == (33, 34, 35)
    assert planned_shape(shapes, 2) == (64, 64, 35)
