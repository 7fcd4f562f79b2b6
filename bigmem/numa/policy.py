"""NUMA placement requests: parse ``--numa``, ``--cpus`` and ``--threads`` against a topology.

Policies (``--numa``):
  interleave[:NODES]  pages round-robin over NODES (default: every node); for one model larger than a socket
  local               pages on the node of the CPU that first touches them
  bind:NODES          pages only from NODES, threads on NODES' CPUs
  preferred:N         pages from N while it has room, then elsewhere
  none                leave the kernel's default policy alone

NODES is a list such as 0,1 or 0-3. Nothing here touches the process: ``apply.py`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from bigmem.errors import UsageError
from bigmem.numa.topology import NUMATopology, parse_cpulist

POLICY_FORMS = "interleave[:NODES], local, bind:NODES, preferred:N or none (NODES such as 0,1 or 0-3)"


class PolicyKind(str, Enum):
    """The memory policies ``--numa`` accepts (see the module docstring)."""

    INTERLEAVE = "interleave"
    LOCAL = "local"
    BIND = "bind"
    PREFERRED = "preferred"
    NONE = "none"


@dataclass(frozen=True)
class Placement:
    """Where memory and threads go: the memory policy, the CPUs, and TF's thread-pool sizes."""

    kind: PolicyKind
    nodes: tuple[int, ...]  # the nodes the policy names (all nodes for interleave without a list)
    cpus: tuple[int, ...]  # the CPU affinity of the process (and so of every thread it creates)
    intra_op_threads: int
    inter_op_threads: int
    text: str = field(default="none")  # what the user asked for
    note: str = ""  # where the threads run when that is not where the memory is (bind to memory-only nodes)

    @property
    def numa_maps_policy(self) -> str:
        """How /proc/PID/numa_maps spells this policy (for comparing requested with observed)."""
        nodes = format_nodes(self.nodes)
        return {PolicyKind.INTERLEAVE: f"interleave:{nodes}", PolicyKind.BIND: f"bind:{nodes}",
                PolicyKind.PREFERRED: f"prefer:{nodes}", PolicyKind.LOCAL: "local",
                PolicyKind.NONE: "default"}[self.kind]

    def to_dict(self) -> dict:
        """The placement as JSON values (``numa.json``'s ``requested``).

        Returns:
            ``{policy, text, nodes, cpus, intra_op_threads, inter_op_threads, note}``.
        """
        return {"policy": self.kind.value, "text": self.text, "nodes": list(self.nodes), "cpus": list(self.cpus),
                "intra_op_threads": self.intra_op_threads, "inter_op_threads": self.inter_op_threads,
                "note": self.note}


def format_nodes(nodes) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (the kernel's nodelist format)."""
    parts, start = [], None
    nodes = sorted(nodes)
    for i, node in enumerate(nodes):
        start = node if start is None else start
        if i + 1 == len(nodes) or nodes[i + 1] != node + 1:
            parts.append(str(start) if start == node else f"{start}-{node}")
            start = None
    return ",".join(parts)


def _parse_nodes(text: str, topology: NUMATopology, flag: str, spec: str) -> tuple[int, ...]:
    try:
        nodes = parse_cpulist(text)
    except Exception:
        nodes = ()
    if not nodes:
        raise UsageError(f"Invalid {flag} {spec!r}: cannot read the node list {text!r}; expected {POLICY_FORMS}.")
    existing = [n.node_id for n in topology.nodes]
    missing = [n for n in nodes if n not in existing]
    if missing:
        raise UsageError(f"Invalid {flag} {spec!r}: node {missing[0]} does not exist; this machine has "
                         f"node{'s' if len(existing) > 1 else ''} {format_nodes(existing)}.")
    return nodes


def parse_policy(text: str, topology: NUMATopology) -> tuple[PolicyKind, tuple[int, ...]]:
    """'bind:0,1' -> (BIND, (0, 1)), checked against the nodes that exist."""
    flag = "{numa.policy}"
    spec = (text or "none").strip().lower()
    name, _, argument = spec.partition(":")
    try:
        kind = PolicyKind(name)
    except ValueError:
        from bigmem.config.options import suggest

        hint = suggest(name, [k.value for k in PolicyKind])
        raise UsageError(f"Invalid {flag} {text!r}: expected {POLICY_FORMS}." + hint) from None
    all_nodes = tuple(n.node_id for n in topology.nodes)
    if kind in (PolicyKind.NONE, PolicyKind.LOCAL):
        if argument:
            raise UsageError(f"Invalid {flag} {text!r}: '{name}' takes no node list; expected {POLICY_FORMS}.")
        return kind, all_nodes
    if kind is PolicyKind.INTERLEAVE:
        return kind, _parse_nodes(argument, topology, flag, text) if argument else all_nodes
    if not argument:
        raise UsageError(f"Invalid {flag} {text!r}: '{name}' needs a node, e.g. {name}:0; expected {POLICY_FORMS}.")
    nodes = _parse_nodes(argument, topology, flag, text)
    if kind is PolicyKind.PREFERRED and len(nodes) != 1:
        raise UsageError(f"Invalid {flag} {text!r}: 'preferred' takes one node, e.g. preferred:0.")
    return kind, nodes


def _check_cpu_ranges(text: str, allowed_cpus: set[int]) -> None:
    """Raise ``UsageError`` unless every CPU of the list ``text`` ('0-15,32-47') is in ``allowed_cpus``.

    Reads each range's bounds without expanding it, so a list such as '0-99999999' is refused at
    once, naming its first CPU outside the allowed ones.
    """
    invalid = UsageError(f"Invalid {{numa.cpus}} {text!r}: expected a CPU list such as 0-15,32-47.")
    ranges = []
    for part in text.strip().split(","):
        if not part.strip():
            continue
        low, dash, high = part.partition("-")
        try:
            bounds = (int(low), int(high) if dash else int(low))
        except ValueError:
            raise invalid from None
        if bounds[0] < 0 or bounds[0] > bounds[1]:
            raise invalid
        ranges.append(bounds)
    if not ranges:
        raise invalid
    top = max(allowed_cpus, default=-1)
    for low, high in sorted(ranges):
        # the first CPU of [low, high] outside the allowed set: at most top + 2 - low candidates
        outside = next((c for c in range(low, min(high, top + 1) + 1) if c not in allowed_cpus), None)
        if outside is None and high > top:
            outside = max(low, top + 1)
        if outside is not None:
            raise UsageError(f"Invalid {{numa.cpus}} {text!r}: CPU {outside} is outside the CPUs this process may use "
                             f"({format_nodes(sorted(allowed_cpus))}).")


# Intel's guide for TensorFlow on Xeon says inter = sockets, written for MKL builds whose ops each
# start their own OpenMP team. Stock TF's oneDNN ops share the one intra-op pool, so two ops in
# flight do not oversubscribe it, and a U-Net's backward has independent pairs (a conv's input
# and filter gradients; the two skip convolutions). Measured on the 2-core dev machine, kits19
# fp32 batch 1: 32^3 0.185 s/step with 1 inter-op thread, 0.158 s with 2; 96^3 within noise.
INTER_OP_PER_NODE = 2


def resolve_placement(policy: str | None, cpus: str | None, threads: int | None, topology: NUMATopology,
                      allowed_cpus: set[int]) -> Placement:
    """The full placement: policy, CPU set, and TF intra-/inter-op thread counts.

    CPUs default to the allowed CPUs of the policy's nodes for bind (threads follow their memory;
    nodes without CPUs, such as CXL memory expanders, lend the CPUs of the nearest nodes that have
    some, and ``Placement.note`` says so) and to every allowed CPU otherwise. Intra-op threads
    default to the number of CPUs; inter-op threads to INTER_OP_PER_NODE per node those CPUs span.
    """
    kind, nodes = parse_policy(policy or "none", topology)
    node_of = {cpu: n.node_id for n in topology.nodes for cpu in n.cpus}
    note = ""
    if cpus:
        _check_cpu_ranges(cpus, allowed_cpus)  # before expanding: '0-99999999' is 10^8 CPUs
        chosen = parse_cpulist(cpus)
    elif kind is PolicyKind.BIND:
        chosen, note = _bound_cpus(nodes, topology, allowed_cpus, policy)
    else:
        chosen = tuple(sorted(allowed_cpus))
    if threads is not None and threads < 1:
        raise UsageError(f"Invalid {{numa.threads}} {threads}: expected a positive integer.")
    intra = threads or len(chosen)
    inter = INTER_OP_PER_NODE * max(1, len({node_of.get(c, 0) for c in chosen}))
    return Placement(kind, nodes, tuple(chosen), intra, inter, text=policy or "none", note=note)


def _bound_cpus(nodes: tuple[int, ...], topology: NUMATopology, allowed_cpus: set[int],
                policy: str) -> tuple[tuple[int, ...], str]:
    """(CPUs, note) for bind:NODES: the nodes' own allowed CPUs, or, when none of them has CPUs, the
    allowed CPUs of the nodes nearest to them by the kernel's distances."""
    none_allowed = UsageError(f"Invalid {{numa.policy}} {policy!r}: none of the CPUs this process may use are on "
                              f"node(s) {format_nodes(nodes)}.")
    if any(topology.node(n).cpus for n in nodes):
        chosen = tuple(c for c in sorted(allowed_cpus) if any(c in topology.node(n).cpus for n in nodes))
        if not chosen:
            raise none_allowed
        return chosen, ""
    index = {node.node_id: i for i, node in enumerate(topology.nodes)}

    def distance(node) -> int:  # from the nearest bound node; 255 (unreachable) where sysfs has no distances
        return min((topology.node(b).distances[index[node.node_id]]
                    if index[node.node_id] < len(topology.node(b).distances) else 255) for b in nodes)

    lending = [node for node in topology.nodes if any(c in allowed_cpus for c in node.cpus)]
    if not lending:
        raise none_allowed
    nearest = min(distance(node) for node in lending)
    near = [node for node in lending if distance(node) == nearest]
    chosen = tuple(sorted(c for node in near for c in node.cpus if c in allowed_cpus))
    return chosen, (f"node(s) {format_nodes(nodes)} have memory but no CPUs; threads run on the nearest node(s) "
                    f"{format_nodes([node.node_id for node in near])} (CPUs {format_nodes(chosen)}, distance "
                    f"{nearest}).")
