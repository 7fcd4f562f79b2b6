"""Parsing --numa/--cpus/--threads against fake 2- and 4-socket machines."""

from __future__ import annotations

import pytest

from bigmem.errors import UsageError
from bigmem.numa.policy import PolicyKind, parse_policy, resolve_placement
from bigmem.numa.topology import NUMATopology
from helpers import make_sysfs


def _all_cpus(topology):
    return {c for n in topology.nodes for c in n.cpus}


@pytest.mark.parametrize("text, kind, nodes", [
    ("interleave", PolicyKind.INTERLEAVE, (0, 1, 2, 3)), ("interleave:1-2", PolicyKind.INTERLEAVE, (1, 2)),
    ("bind:0,2", PolicyKind.BIND, (0, 2)), ("preferred:3", PolicyKind.PREFERRED, (3,)),
    ("local", PolicyKind.LOCAL, (0, 1, 2, 3)), ("none", PolicyKind.NONE, (0, 1, 2, 3)),
    ("BIND:1", PolicyKind.BIND, (1,)),
])
def test_policy_forms(four_socket, text, kind, nodes):
    assert parse_policy(text, NUMATopology.from_sysfs(four_socket)) == (kind, nodes)


FORMS = "expected interleave[:NODES], local, bind:NODES, preferred:N or none (NODES such as 0,1 or 0-3)."


@pytest.mark.parametrize("text, message", [
    ("bind:4", "Invalid numa.policy 'bind:4': node 4 does not exist; this machine has nodes 0-3."),
    ("interleaved", f"Invalid numa.policy 'interleaved': {FORMS} Did you mean 'interleave'?"),
    ("bind", f"Invalid numa.policy 'bind': 'bind' needs a node, e.g. bind:0; {FORMS}"),
    ("bind:x", f"Invalid numa.policy 'bind:x': cannot read the node list 'x'; {FORMS}"),
    ("local:1", f"Invalid numa.policy 'local:1': 'local' takes no node list; {FORMS}"),
    ("preferred:0,1", "Invalid numa.policy 'preferred:0,1': 'preferred' takes one node, e.g. preferred:0."),
])
def test_policy_errors(four_socket, text, message):
    with pytest.raises(UsageError) as info:
        parse_policy(text, NUMATopology.from_sysfs(four_socket))
    assert str(info.value) == message


def test_bind_runs_threads_on_the_bound_nodes(two_socket):
    topology = NUMATopology.from_sysfs(two_socket)
    placement = resolve_placement("bind:1", None, None, topology, _all_cpus(topology))
    assert placement.cpus == tuple(range(24, 48)) + tuple(range(72, 96))
    assert (placement.intra_op_threads, placement.inter_op_threads) == (48, 2)
    assert placement.numa_maps_policy == "bind:1"


def test_interleave_uses_every_cpu_and_two_inter_op_threads_per_socket(four_socket):
    topology = NUMATopology.from_sysfs(four_socket)
    placement = resolve_placement("interleave", None, None, topology, _all_cpus(topology))
    assert placement.cpus == tuple(range(80))
    assert (placement.intra_op_threads, placement.inter_op_threads) == (80, 8)
    assert placement.numa_maps_policy == "interleave:0-3"
    assert placement.to_dict()["nodes"] == [0, 1, 2, 3]


def test_cpus_and_threads_flags(four_socket):
    topology = NUMATopology.from_sysfs(four_socket)
    placement = resolve_placement("local", "0-9,20-29", 16, topology, _all_cpus(topology))
    assert placement.cpus == tuple(range(10)) + tuple(range(20, 30))
    assert (placement.intra_op_threads, placement.inter_op_threads) == (16, 4)
    assert resolve_placement("preferred:2", None, None, topology, _all_cpus(topology)).numa_maps_policy == "prefer:2"


def test_bind_respects_the_allowed_cpus(two_socket):
    topology = NUMATopology.from_sysfs(two_socket)
    allowed = set(range(0, 10))  # e.g. a cgroup gave this process 10 CPUs of node 0
    assert resolve_placement("bind:0", None, None, topology, allowed).cpus == tuple(range(10))
    with pytest.raises(UsageError, match=r"^Invalid numa.policy 'bind:1': none of the CPUs this process may use are on "
                                         r"node\(s\) 1\.$"):
        resolve_placement("bind:1", None, None, topology, allowed)


@pytest.mark.parametrize("cpus, threads, message", [
    ("0-99", None, "Invalid numa.cpus '0-99': CPU 96 is outside the CPUs this process may use (0-95)."),
    ("a-b", None, "Invalid numa.cpus 'a-b': expected a CPU list such as 0-15,32-47."),
    (None, 0, "Invalid numa.threads 0: expected a positive integer."),
])
def test_cpu_and_thread_errors(two_socket, cpus, threads, message):
    topology = NUMATopology.from_sysfs(two_socket)
    with pytest.raises(UsageError) as info:
        resolve_placement("none", cpus, threads, topology, _all_cpus(topology))
    assert str(info.value) == message


def test_bind_to_memory_only_nodes_runs_threads_on_the_nearest_cpus(tmp_path):
    # two sockets and a CXL expander (no CPUs) nearer socket 1, as sysfs shows them
    topology = NUMATopology.from_sysfs(make_sysfs(tmp_path, [("0-3", 64, 60), ("4-7", 64, 60), ("", 256, 250)],
                                                  [[10, 21, 24], [21, 10, 14], [24, 14, 10]]))
    placement = resolve_placement("bind:2", None, None, topology, _all_cpus(topology))
    assert (placement.nodes, placement.cpus, placement.numa_maps_policy) == ((2,), (4, 5, 6, 7), "bind:2")
    assert placement.note == ("node(s) 2 have memory but no CPUs; threads run on the nearest node(s) 1 "
                              "(CPUs 4-7, distance 14).")
    assert resolve_placement("bind:1,2", None, None, topology, _all_cpus(topology)).cpus == (4, 5, 6, 7)
    assert resolve_placement("bind:1", None, None, topology, _all_cpus(topology)).note == ""
    # the nearest node's CPUs are not ours (a cgroup): the next nearest lends them
    assert resolve_placement("bind:2", None, None, topology, {0, 1}).cpus == (0, 1)
