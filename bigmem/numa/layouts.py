"""The two ways to run one job on a multi-node machine, and whether each fits: ``evaluate_layouts``.

- **interleave**: one process whose pages are spread round-robin over every node. Each node
  holds ``peak / nodes``, so the budget is the smallest node's free memory times the nodes
  (``numa.capacity.placement_budget``, the rule ``--numa interleave`` is budgeted by). With N
  nodes, (N-1)/N of its memory accesses go to another node; it is the only layout for a job
  whose batch of 1 needs more than one node's memory.
- **per-node**: one worker per node that has CPUs (``bigmem train --strategy per-node``), each
  bound to its node, each at ``--batch-size``; the global batch is workers x batch. Every worker
  holds its own framework, weights, gradients and optimizer slots, so its peak is the whole
  estimate at its batch, not a share of one process's; it fits only if every worker's node has
  that much free. Its memory traffic stays on its own node. Memory-only nodes (CXL expanders)
  carry no worker.

Throughput is not modelled: which layout steps faster was not measured here (benchmarks/results/numa.md,
"Interleave against per-node: published figures").
"""

from __future__ import annotations

from dataclasses import dataclass

from bigmem.numa.capacity import placement_budget
from bigmem.numa.policy import Placement, PolicyKind
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes

INTERLEAVE = "interleave"
PER_NODE = "per-node"


@dataclass(frozen=True)
class NodeShare:
    """What one node must hold under a layout.

    Attributes:
        node_id: the kernel's node number.
        free_bytes: its free memory (``NUMANode.free_bytes``).
        required_bytes: what the layout puts on it: interleave, the peak over the nodes; per-node,
            its worker's whole peak (0 on a node without a worker).
        worker: whether a process runs on its CPUs (per-node: nodes with CPUs; interleave: False,
            the one process runs wherever its CPUs are).
    """

    node_id: int
    free_bytes: int
    required_bytes: int
    worker: bool = False

    @property
    def fits(self) -> bool:
        """Whether the node has room for what it must hold."""
        return self.required_bytes <= self.free_bytes

    def to_dict(self) -> dict:
        """``{node, free_bytes, required_bytes, worker, fits}``."""
        return {"node": self.node_id, "free_bytes": self.free_bytes, "required_bytes": self.required_bytes,
                "worker": self.worker, "fits": self.fits}


@dataclass(frozen=True)
class Layout:
    """One layout's verdict.

    Attributes:
        name: ``"interleave"`` or ``"per-node"``.
        num_processes: 1 for interleave; the nodes with CPUs for per-node.
        batch_size: each process's batch (``--batch-size``).
        predicted_peak_bytes: each process's predicted peak at that batch.
        budget_bytes: what that peak is judged against: interleave, the smallest free x nodes;
            per-node, the smallest free memory of a node that carries a worker.
        nodes: per node, what it must hold (``NodeShare``).
        reason: one line: why it fits, or the node that does not and by how much.
    """

    name: str
    num_processes: int
    batch_size: int
    predicted_peak_bytes: int
    budget_bytes: int
    nodes: tuple[NodeShare, ...]
    reason: str

    @property
    def global_batch_size(self) -> int:
        """Cases per step across all processes: processes x batch."""
        return self.num_processes * self.batch_size

    @property
    def fits(self) -> bool:
        """Whether every node can hold its part (and there is a process at all)."""
        return self.num_processes > 0 and all(n.fits for n in self.nodes)

    def to_dict(self) -> dict:
        """plan.json's entry: ``{layout, num_processes, batch_size, global_batch_size, predicted_peak_bytes,
        budget_bytes, fits, reason, nodes: [...]}``."""
        return {"layout": self.name, "num_processes": self.num_processes, "batch_size": self.batch_size,
                "global_batch_size": self.global_batch_size, "predicted_peak_bytes": self.predicted_peak_bytes,
                "budget_bytes": self.budget_bytes, "fits": self.fits, "reason": self.reason,
                "nodes": [n.to_dict() for n in self.nodes]}


@dataclass(frozen=True)
class Layouts:
    """Both layouts of one job on one machine, and the one to pick.

    Attributes:
        interleave: one process over all nodes.
        per_node: one worker per node with CPUs.
        topology_source: where the nodes were read from.
    """

    interleave: Layout
    per_node: Layout
    topology_source: str

    @property
    def recommended(self) -> str | None:
        """per-node when it fits (each worker's traffic stays local), else interleave when it fits, else None."""
        if self.per_node.fits:
            return PER_NODE
        return INTERLEAVE if self.interleave.fits else None

    def to_dict(self) -> dict:
        """plan.json's ``layouts``: ``{recommended, topology_source, interleave: {...}, per_node: {...}}``."""
        return {"recommended": self.recommended, "topology_source": self.topology_source,
                "interleave": self.interleave.to_dict(), "per_node": self.per_node.to_dict()}


def evaluate_layouts(predicted_peak_bytes: int, batch_size: int, topology: NUMATopology) -> Layouts | None:
    """Whether a job fits interleaved over all nodes, and one worker per node with CPUs.

    Args:
        predicted_peak_bytes: the job's predicted peak at ``batch_size`` (``memory.estimate``): one
            process's, and so each per-node worker's, since every worker holds its own framework,
            weights and optimizer.
        batch_size: each process's batch (``--batch-size``).
        topology: the machine's nodes (``NUMATopology.from_sysfs``).

    Returns:
        The two ``Layout`` verdicts, or None on a machine of one node (there is nothing to choose).

    Example:
        >>> layouts = evaluate_layouts(500 * 2**30, 1, NUMATopology.from_sysfs("/fake/2x768GiB"))
        >>> layouts.interleave.fits, layouts.per_node.fits, layouts.recommended
        (True, False, 'interleave')
    """
    if topology.num_nodes < 2:
        return None
    peak = int(predicted_peak_bytes)
    return Layouts(_interleave(peak, batch_size, topology), _per_node(peak, batch_size, topology), topology.source)


def _interleave(peak: int, batch_size: int, topology: NUMATopology) -> Layout:
    """One process, its pages spread evenly: each node holds peak / nodes."""
    nodes = tuple(n.node_id for n in topology.nodes)
    placement = Placement(PolicyKind.INTERLEAVE, nodes, (), 1, 1, text=INTERLEAVE)
    budget, _ = placement_budget(placement, topology, 0)
    share = -(-peak // len(nodes))
    shares = tuple(NodeShare(n.node_id, n.free_bytes, share) for n in topology.nodes)
    worst = _tightest(shares)
    if worst:
        reason = (f"{format_bytes(peak)} over {len(nodes)} nodes puts {format_bytes(share)} on each; node "
                  f"{worst.node_id} has {format_bytes(worst.free_bytes)} free")
    else:
        reason = f"{format_bytes(share)} on each of {len(nodes)} nodes; every node has room"
    return Layout(INTERLEAVE, 1, batch_size, peak, budget, shares, reason)


def _per_node(peak: int, batch_size: int, topology: NUMATopology) -> Layout:
    """One worker per node with CPUs, each holding its whole peak on its own node."""
    shares = tuple(NodeShare(n.node_id, n.free_bytes, peak if n.cpus else 0, worker=bool(n.cpus))
                   for n in topology.nodes)
    workers = [s for s in shares if s.worker]
    if not workers:
        return Layout(PER_NODE, 0, batch_size, peak, 0, shares, "no node has CPUs to run a worker on")
    budget = min(s.free_bytes for s in workers)
    memory_only = [s.node_id for s in shares if not s.worker]
    spare = f"; node(s) {','.join(map(str, memory_only))} have no CPUs and carry no worker" if memory_only else ""
    worst = _tightest(workers)
    if worst:
        reason = (f"each worker needs {format_bytes(peak)} on its own node; node {worst.node_id} has "
                  f"{format_bytes(worst.free_bytes)} free{spare}")
    else:
        reason = f"{len(workers)} workers x {format_bytes(peak)}, each within its own node's free memory{spare}"
    return Layout(PER_NODE, len(workers), batch_size, peak, budget, shares, reason)


def _tightest(shares) -> NodeShare | None:
    """The node with the least free memory among those its share does not fit, the one a refusal names."""
    return min((s for s in shares if not s.fits), key=lambda s: s.free_bytes, default=None)
