"""The planning records: the budget and the parts of a ``Plan`` beside its candidates, each typed and frozen.

A plan is made whole where it is built (``memory.plans``, ``memory.search.make_plan``) and changed
only by ``dataclasses.replace``; plan.json is ``Plan.to_dict``, which writes each record as
``dataclasses.asdict`` gives it (its fields in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the numa and experiment types are only annotations here
    from bigmem.data.experiment import Experiment
    from bigmem.numa.policy import Placement
    from bigmem.numa.topology import NUMATopology


@dataclass(frozen=True)
class Budget:
    """A resolved memory budget and where it came from (``memory.budget.resolve_budget``).

    Attributes:
        budget_bytes: the most the job's predicted peak may be.
        source: what set it, as messages and plan.json's ``budget_source`` name it: the flag
            (``"--memory-budget"``, ``"--budget"``), the placement (``"free memory of node(s) 1"``)
            or ``"MemAvailable"``.
        note: one line to show the user when an explicit budget was capped ("" otherwise).
        placement: the placement whose nodes set the budget, when they did (the refusal then names
            the nodes); None otherwise.
        topology: the topology ``placement`` was measured on.
    """

    budget_bytes: int
    source: str
    note: str = ""
    placement: "Placement | None" = None
    topology: "NUMATopology | None" = None


@dataclass(frozen=True)
class CaseRow:
    """One training case of a job on a store's own shapes: its shape, the shape it trains at, its step's peak."""

    case: str
    shape: list[int]
    padded_shape: list[int]
    predicted_peak_bytes: int
    fits: bool


@dataclass(frozen=True)
class ValidationPass:
    """The held-out validation pass beside training (``memory.plans.validation_figures``).

    Attributes:
        case, shape: the largest held-out case and its padded shape.
        predicted_peak_bytes: resident + pass + margin.
        resident_bytes: what training keeps allocated meanwhile (framework, weights, gradients, slots, pipeline).
        pass_bytes: the inference pass's own (input copies, live feature maps, slack, probabilities).
        safety_margin_bytes: each part's own margin.
        training_peak_bytes: the training step's predicted peak.
        excess_bytes: how far validation's peak exceeds training's (0 when it does not).
    """

    case: str
    shape: list[int]
    predicted_peak_bytes: int
    resident_bytes: int
    pass_bytes: int
    safety_margin_bytes: int
    training_peak_bytes: int
    excess_bytes: int


@dataclass(frozen=True)
class BatchCap:
    """A store's cap on the batch: nnU-Net's share of the dataset one step may see.

    Attributes:
        cap: the largest batch allowed.
        dataset_voxels: the training cases' voxels.
        sample_voxels: the voxels of one sample of a batch (the bounding shape of the cases).
        uncapped: the batch memory alone allowed (None when nothing fit).
        rule: the rule, in words.
    """

    cap: int
    dataset_voxels: int
    sample_voxels: int
    uncapped: int | None
    rule: str = "one step sees at most 5% of the training cases' voxels, at least 2 (nnU-Net's)"


class DataParallelRun(Protocol):
    """How a job runs data parallel (``distribute.execution.Execution``, a layer above): plan.json's
    ``data_parallel`` is its ``to_dict`` (None for a single process)."""

    def to_dict(self) -> dict | None: ...


@dataclass(frozen=True)
class PlannedExperiment:
    """The network configured from a store (``bigmem plan --data``) and the preset file written for it."""

    experiment: "Experiment"
    preset: str | None

    def to_dict(self) -> dict:
        """plan.json's ``experiment``: ``Experiment.to_dict`` and ``preset``."""
        return {**self.experiment.to_dict(), "preset": self.preset}


__all__ = ["BatchCap", "Budget", "CaseRow", "DataParallelRun", "PlannedExperiment", "ValidationPass"]
