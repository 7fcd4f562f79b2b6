"""Does augmentation help on subjects the model never saw? Dice on held-out stand-in subjects.

    python benchmarks/proofs/bench_augment_helps.py [--volume 64] [--steps 300] [--seeds 0 1 2]
        [--augments none light nnunet] [--quick] [--out DIR]

The stand-in for distinct subjects: one template (a phantom with 3 foreground classes) warped into
``--train-subjects + --test-subjects`` subjects, each by its own random pose (rotation up to
``--max-rotation`` degrees about a random axis), scale (0.8-1.2), smooth deformation (a random
displacement field, Gaussian-smoothed, ~2 voxels), bias field and noise, and intensity contrast.
``bigmem train --model small`` trains on the first subjects (``--holdout`` keeps the rest out) at
equal steps for each ``--augment`` setting and seed, with and without ``--deep-supervision`` for
``nnunet``, and validates the held-out subjects at the end (``val_dice``: predict + evaluate on
them). Prints the mean and spread per setting and writes JSON keyed by machine (never run by
pytest).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, command_line, write_results

TEMPLATE_SEED = 11


def _rotation(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rodrigues' rotation matrix about unit ``axis``."""
    axis = axis / np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def subject(template_image: np.ndarray, template_label: np.ndarray, rng: np.random.Generator,
            max_rotation_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """One stand-in subject: the template under its own pose, scale, deformation, bias field, noise and contrast."""
    from scipy import ndimage

    shape = template_label.shape
    centre = (np.asarray(shape) - 1) / 2
    matrix = _rotation(rng.normal(size=3), math.radians(rng.uniform(-max_rotation_deg, max_rotation_deg)))
    matrix = matrix * rng.uniform(0.8, 1.2)
    grid = np.stack(np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij"))
    coords = np.einsum("ij,j...->i...", matrix, grid - centre[:, None, None, None]) + centre[:, None, None, None]
    for axis in range(3):  # a smooth random displacement, about 2 voxels
        field = ndimage.gaussian_filter(rng.normal(size=shape), sigma=shape[0] / 8)
        coords[axis] += 2.0 * field / (np.abs(field).max() + 1e-6)
    image = ndimage.map_coordinates(template_image, coords, order=1, mode="nearest").astype(np.float32)
    label = ndimage.map_coordinates(template_label, coords, order=0, mode="constant", cval=0).astype(np.uint8)
    axes = [np.linspace(-1, 1, s) for s in shape]
    bias = 1.0 + 0.2 * np.sin(sum(rng.uniform(0.5, 1.5) * np.meshgrid(*axes, indexing="ij")[i] for i in range(3))
                              + rng.uniform(0, 2 * math.pi))
    image = image * bias * rng.uniform(0.8, 1.25) + rng.normal(0, 0.08, shape)
    return image[..., None].astype(np.float32), label


def write_subjects(path: Path, volume: int, count: int, max_rotation_deg: float, seed: int = 0) -> Path:
    from bigmem.data.store import StoreWriter
    from bigmem.data.synth import make_phantom

    template_image, template_label = make_phantom(np.random.default_rng(TEMPLATE_SEED), (volume,) * 3, 4)
    with StoreWriter(path, num_classes=4, channel_names=["synthetic"],
                     label_names=["background", "class1", "class2", "class3"]) as writer:
        for index in range(count):
            image, label = subject(template_image[..., 0], template_label, np.random.default_rng([seed, index]),
                                   max_rotation_deg)
            writer.add_case(f"subject_{index:02d}", image, label, source_image=f"stand-in:subject={index}")
        return writer.commit()


def train(store: Path, out: Path, *, augment: str, seed: int, steps: int, holdout: int, deep: bool) -> dict:
    command = [sys.executable, "-m", "bigmem", "train", "--model", "small", "--data", str(store), "--steps",
               str(steps), "--holdout", str(holdout), "--val-every", str(steps), "--augment", augment, "--seed",
               str(seed), "--monitor-interval", "0", "--checkpoint-every", str(steps), "--out", str(out),
               "--deep-supervision" if deep else "--no-deep-supervision"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"augment": augment, "deep_supervision": deep, "seed": seed, "val_dice": summary["val_dice"],
            "val_dice_per_class": summary.get("val_dice_per_class"), "final_loss": summary.get("final_loss"),
            "wall_s": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"volume": 32, "steps": 4, "seeds": [0], "train_subjects": 2,
                                          "test_subjects": 2})
    parser.add_argument("--volume", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--augments", nargs="+", default=["none", "light", "nnunet"])
    parser.add_argument("--train-subjects", type=int, default=4)
    parser.add_argument("--test-subjects", type=int, default=4)
    parser.add_argument("--max-rotation", type=float, default=25.0, help="degrees of the subjects' pose")
    parser.add_argument("--no-deep-supervision-arm", action="store_true", help="skip the nnunet + DS runs")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.sysinfo import collect_sysinfo

    console = Console()
    runs = []
    arms = [(augment, False) for augment in args.augments]
    if not args.no_deep_supervision_arm and "nnunet" in args.augments:
        arms.append(("nnunet", True))
    with tempfile.TemporaryDirectory() as folder:
        store = write_subjects(Path(folder) / "subjects.h5", args.volume, args.train_subjects + args.test_subjects,
                               args.max_rotation)
        for seed in args.seeds:
            for augment, deep in arms:
                console.print(f"seed {seed}: --augment {augment}{' --deep-supervision' if deep else ''} ...")
                runs.append(train(store, Path(folder) / f"{augment}-{deep}-{seed}", augment=augment, seed=seed,
                                  steps=args.steps, holdout=args.test_subjects, deep=deep))
                console.print(f"  val Dice {runs[-1]['val_dice']:.4f} ({runs[-1]['wall_s']:.0f} s)")
    table = Table(title=f"Dice on {args.test_subjects} unseen subjects: small, {args.volume}^3, {args.steps} steps, "
                        f"trained on {args.train_subjects}")
    for column in ("augment", "deep supervision", "seeds", "mean Dice", "min", "max"):
        table.add_column(column, justify="right")
    summary = []
    for augment, deep in arms:
        dice = [r["val_dice"] for r in runs if r["augment"] == augment and r["deep_supervision"] == deep]
        row = {"augment": augment, "deep_supervision": deep, "seeds": len(dice), "mean": statistics.mean(dice),
               "min": min(dice), "max": max(dice), "stdev": statistics.stdev(dice) if len(dice) > 1 else None}
        summary.append(row)
        table.add_row(augment, "on" if deep else "off", str(len(dice)), f"{row['mean']:.4f}", f"{row['min']:.4f}",
                      f"{row['max']:.4f}")
    console.print(table)
    write_results("augment_helps", {"machine": collect_sysinfo(include_tensorflow=False),
                                    "command": command_line(__file__), "settings": vars(args), "runs": runs,
                                    "summary": summary}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
