"""An experiment configured from a store: nnU-Net v2's network rules for whole cases, the rest from the planner.

``bigmem plan --data STORE`` (with no ``--model``, or ``--model auto``) reads the store's fingerprint
(``data.fingerprint``: each case's spacing and shape), and sets the network as nnU-Net v2's
``ExperimentPlanner`` sets its 3d_fullres one (``config.topology``): the target spacing, each stage's
kernel and stride per axis, the stages until the bottleneck is about 4 voxels, 32 x 2^stage features
capped at 320. The "patch" those rules size is the median case whole, not a GPU's patch. The network is
nnU-Net's ``PlainConvUNet`` as its planner configures it: two conv-norm-LeakyReLU blocks per stage
(strided convolutions down, conv bias on, instance norm), deep supervision, and nnU-Net's training recipe
(``train.recipe``).

The memory planner then chooses the batch, precision and recompute mode for that network on the store's
own shapes, and the batch is capped by the dataset (``dataset_batch_cap``). The result is written as a
preset TOML (``write_preset``) that ``bigmem train --plan FILE`` (or ``--model FILE``) trains.

Resampling happens at convert (``bigmem convert --spacing``), which records it in the store so predict
maps each prediction back to its scan's own grid. A store whose cases are not at the target spacing is
planned at their median and the plan says which ``--spacing`` to convert with (``Experiment.resampling``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bigmem.config.topology import Topology, batch_cap
from bigmem.data.fingerprint import Fingerprint, fingerprint

# The file ``bigmem plan --data`` writes beside plan.json.
EXPERIMENT_FILE = "experiment.toml"
# A case within this share of the target spacing on every axis is at it (convert --spacing resamples to a
# whole number of voxels over the field of view, so its spacing is close to, not exactly, the target).
SPACING_TOLERANCE = 0.05
# nnU-Net v2's 3d_fullres network as its planner configures it (ExperimentPlanner: PlainConvUNet, conv_bias
# True, InstanceNorm3d, LeakyReLU, n_conv_per_stage 2 down and up, deep supervision) in ModelConfig's terms.
NNUNET_NETWORK: dict[str, Any] = {"blocks_per_level": 2, "norm": "instance", "activation": "leaky_relu",
                                  "downsampling": "strided", "conv_bias": True, "deep_supervision": True}


@dataclass(frozen=True)
class Experiment:
    """The experiment a store configures, before the memory planner sizes its batch.

    Attributes:
        store: the store's path.
        fingerprint: its cases' spacings and shapes.
        topology: the network nnU-Net's rules give the median case at the target spacing.
        off_spacing: the case furthest from the target spacing, its spacing and how far off (a share), where
            one is more than ``SPACING_TOLERANCE`` off; else None.
    """

    store: str
    fingerprint: Fingerprint
    topology: Topology
    off_spacing: tuple[str, tuple[float, float, float], float] | None

    @property
    def resampling(self) -> str | None:
        """What to do where the store's cases are not at the target spacing; None where they are.

        Example:
            >>> experiment.resampling
            "case 'b' is at 1x1x2.5 mm, not the target 1x1x1.5 mm: convert with --spacing 1,1,1.5 ..."
        """
        if self.off_spacing is None:
            return None
        case_id, spacing, _ = self.off_spacing
        target = self.topology.spacing
        return (f"case {case_id!r} is at {_mm(spacing)} mm, not the target {_mm(target)} mm: convert the dataset "
                f"again with --spacing {','.join(f'{s:g}' for s in target)} (the store's axis order), so that every "
                "case is at the spacing the network is planned for; predict maps each segmentation back to its "
                "scan's own grid.")

    def tables(self, *, batch_size: int, precision: str, recompute: str, description: str | None = None) -> dict:
        """The preset TOML's tables: ``[card]``, ``[model]``, ``[train]``, ``[memory]``.

        Args:
            batch_size, precision, recompute: the memory planner's choice for this network on the store.
            description: the card's line (default: the store's name and the topology in brief).

        Returns:
            Plain values only (``tomli_w`` writes them; ``config.presets.resolve_config`` reads them).
        """
        topology = self.topology
        strides = "/".join("x".join(map(str, s)) for s in topology.strides[1:])
        card = {"description": description or (
                    f"Configured from {Path(self.store).name}: {topology.stages} stages, strides {strides}, "
                    f"at {_mm(topology.spacing)} mm."),
                "reference": "nnU-Net v2's ExperimentPlanner rules (3d_fullres) for the median case whole",
                "target_spacing": list(topology.spacing),
                "median_shape": [round(s, 1) for s in topology.median_shape]}
        model = {**topology.to_model_table(), **NNUNET_NETWORK}
        train = {"recipe": "nnunet", "batch_size": int(batch_size), "precision": precision}
        return {"card": card, "model": model, "train": train, "memory": {"recompute": recompute}}

    def to_dict(self) -> dict:
        """plan.json's ``experiment``: the fingerprint in brief, the spacing, the topology and any resampling."""
        topology = self.topology
        return {"store": self.store, "cases": self.fingerprint.num_cases,
                "target_spacing": list(topology.spacing), "median_shape": list(topology.median_shape),
                "padded_median_shape": list(topology.padded_shape), "stages": topology.stages,
                "kernel_sizes": [list(k) for k in topology.kernel_sizes],
                "strides": [list(s) for s in topology.strides], "features": list(topology.features),
                "divisors": list(topology.divisors), "resampling": self.resampling}


def _mm(spacing: Sequence[float]) -> str:
    return "x".join(f"{s:g}" for s in spacing)


def configure_experiment(store: str | os.PathLike) -> Experiment:
    """The network nnU-Net v2's rules configure for ``store``'s cases, whole (``config.topology``).

    Args:
        store: a store path (every case counts, held-out ones too, as nnU-Net plans from all of them).

    Returns:
        The ``Experiment``; its ``resampling`` says when the cases are not at the target spacing.

    Raises:
        DataError: the store cannot be read, or a case has no spacing.
    """
    prints = fingerprint(store)
    topology = prints.topology()
    target = topology.spacing
    worst = None
    for case_id, spacing in zip(prints.case_ids, prints.spacings):
        off = max(abs(got - want) / want for got, want in zip(spacing, target))
        if off > SPACING_TOLERANCE and (worst is None or off > worst[2]):
            worst = (case_id, tuple(spacing), off)
    return Experiment(str(store), prints, topology, worst)


def dataset_batch_cap(case_shapes: Sequence[Sequence[int]], sample_shape: Sequence[int]) -> int:
    """The largest batch a store's training allows: one step sees at most 5% of the dataset (at least 2).

    nnU-Net's rule (``config.topology.batch_cap``) against overfitting a small dataset: a batch of 53 on a
    store of 3 cases would show every case about 18 times per step. The dataset's voxels here are its
    training cases' own, summed (nnU-Net estimates them as the median case's times the cases), and one
    sample's are the shape a batch of several steps at (nnU-Net: its padded patch).

    Args:
        case_shapes: each training case's own ``(D, H, W)``.
        sample_shape: the shape a batch steps at (``memory.plans.planned_shape`` at batch 2).

    Returns:
        The cap, at least 2.

    Example:
        >>> dataset_batch_cap([(33, 96, 96), (40, 96, 96), (57, 96, 96)], (64, 96, 96))
        2
    """
    dataset = sum(math.prod(int(s) for s in shape[:3]) for shape in case_shapes)
    return batch_cap(dataset, math.prod(int(s) for s in sample_shape[:3]))


def toml_text(tables: dict) -> str:
    """``tables`` (``{table: {key: value}}``, values str, int, float, bool or lists of them) as TOML.

    Written here rather than with ``tomli_w``, which puts every array element on a line of its own: a
    configured preset is read and edited by people, so each stage's kernel and stride stays on one line.
    The text is read back with ``tomllib`` to the same tables (``write_preset`` checks).

    Example:
        >>> print(toml_text({"model": {"depth": 1, "strides": [[1, 1, 1], [1, 2, 2]]}}))
        [model]
        depth = 1
        strides = [[1, 1, 1], [1, 2, 2]]
    """
    def literal(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        if isinstance(value, str):
            return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(literal(v) for v in value) + "]"
        raise TypeError(f"no TOML literal for {value!r}")

    blocks = []
    for name, table in tables.items():
        blocks.append("\n".join([f"[{name}]", *(f"{key} = {literal(value)}" for key, value in table.items())]))
    return "\n\n".join(blocks) + "\n"


def write_preset(tables: dict, path: str | os.PathLike) -> Path:
    """Write ``tables`` (``Experiment.tables``) as a preset TOML at ``path``, atomically.

    Returns:
        The path written.
    """
    from bigmem.atomic import atomic_write_text
    from bigmem.config.presets import tomllib

    text = toml_text(tables)
    if tomllib.loads(text) != json.loads(json.dumps(tables)):  # tuples read back as lists
        raise ValueError(f"the preset's TOML does not read back as written: {text!r}")  # a bug in toml_text
    header = ("# Configured by `bigmem plan --data`: the network from the dataset by nnU-Net v2's experiment\n"
              "# planner rules, the batch, precision and recompute mode from bigmem's memory planner.\n"
              "# Train it with `bigmem train --plan THIS_FILE --data STORE` (or --model THIS_FILE).\n")
    target = Path(path)
    atomic_write_text(target, header + text)
    return target
