"""Does the training recipe pay? Unseen-subject Dice against training time, beside nnU-Net v2 on the same CPU.

    python benchmarks/proofs/bench_recipe_budget.py [--standins brain organs] [--budgets 300 600 1200 2400 4800]
        [--arms ...] [--ablation-budgets 300] [--seeds 0] [--nnunet-python PATH] [--work DIR] [--quick]

Two stand-ins (``standins.py``): MNI152 warped into 4 training subjects and 4 unseen ones from a shifted
scanner, and an anisotropic CT-like abdomen with organs. ``bigmem train --model small`` trains on the 4
training subjects for each arm at each budget (a run whose schedule ends at its budget: ``--steps N``),
then ``bigmem predict`` segments the unseen and the training subjects and ``bigmem evaluate`` scores them
(MONAI's Dice, the mean over foreground classes and subjects).

Arms (``ARMS``): ``default`` (what ``bigmem train`` trains on a store: ``--recipe augmented``), ``recipe``
(nnU-Net's whole: the default with nnU-Net's SGD schedule, ``--recipe nnunet``), ``none`` and ``light`` (the
default's augmentation replaced) and the default without each part (``no-spatial``, ``no-intensity``,
``no-deep-supervision``). The arms other than ``--arms`` run at ``--ablation-budgets`` only.

nnU-Net v2 itself (``--nnunet-python``: a venv with ``pip install torch==2.14.1 torchvision==0.29.1
nnunetv2``; its trainer search imports timm, which needs a torchvision that matches torch; bigmem never
imports either) trains its own default 3d_fullres plan of the same files, fold ``all``, on the CPU, for the
wall-clock bigmem's default (``DEFAULT_ARM``) trained at each budget: a short calibration run gives its seconds per
iteration, and its epochs are set so its poly schedule ends at the budget (250 iterations an epoch as
nnU-Net's, at least 10 epochs; 1 validation iteration per 5 training ones, as its 50 per 250). It
predicts without test-time mirroring, as bigmem predicts here, and the same ``bigmem evaluate`` scores it.

Every run writes ``WORK/<standin>/<arm>/<budget>/seed<k>/result.json`` when it ends; a second invocation
skips what is done, so the study resumes where it stopped. Each invocation rewrites the table, the JSON and
the plot (Dice against hours) in ``--out`` from every result so far. Never run by pytest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results
sys.path.insert(0, str(Path(__file__).resolve().parent))  # standins

from harness import bench_parser, command_line  # noqa: E402

import standins  # noqa: E402

DATASET_IDS = {"brain": 901, "organs": 902}
ARMS = {
    "default": ["--recipe", "augmented"],  # what bigmem train trains on a store without --recipe
    "recipe": ["--recipe", "nnunet"],  # the default with nnU-Net's optimiser and schedule: nnU-Net's whole recipe
    "none": ["--recipe", "augmented", "--augment", "none"],
    "light": ["--recipe", "augmented", "--augment", "light"],
    "no-spatial": ["--recipe", "augmented", "--augment", "intensity"],
    "no-intensity": ["--recipe", "augmented", "--augment", "spatial"],
    "no-deep-supervision": ["--recipe", "augmented", "--no-deep-supervision"],
}
MAIN_ARMS = ("default",)
DEFAULT_ARM = "default"  # --recipe auto on a store (config.presets._with_recipe): augmented
NNUNET_TRAINER = "nnUNetTrainer_bigmemBudget"
NNUNET_ITERATIONS_PER_EPOCH = 250  # nnUNetTrainer.__init__: num_iterations_per_epoch
NNUNET_MIN_EPOCHS = 10  # below this the poly schedule (stepped once an epoch) would hardly decay
# A subclass of nnU-Net's trainer that sets only its length (as its nnUNetTrainer_Xepochs variants do).
# (nnUNetTrainer.__init__ records its own arguments by name, so the signature is spelt out.)
TRAINER_SOURCE = '''import os

import torch

from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer


class nnUNetTrainer_bigmemBudget(nnUNetTrainer):
    def __init__(self, plans: dict, configuration: str, fold: int, dataset_json: dict,
                 device: torch.device = torch.device("cuda")):
        super().__init__(plans, configuration, fold, dataset_json, device)
        self.num_epochs = int(os.environ["BUDGET_EPOCHS"])
        self.num_iterations_per_epoch = int(os.environ["BUDGET_ITERATIONS"])
        self.num_val_iterations_per_epoch = int(os.environ["BUDGET_VAL_ITERATIONS"])
'''
# Trains without nnU-Net's closing validation pass (not training time; the study predicts the same cases).
NNUNET_TRAIN = '''import sys, time, torch
from nnunetv2.run.run_training import get_trainer_from_args
trainer = get_trainer_from_args(sys.argv[1], "3d_fullres", "all", "nnUNetTrainer_bigmemBudget", "nnUNetPlans",
                                device=torch.device("cpu"))
started = time.perf_counter()
trainer.run_training()
print("TRAIN_S", time.perf_counter() - started)
'''


def run(command: list[str], *, env: dict | None = None, what: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if result.returncode:
        raise RuntimeError(f"{what} failed ({' '.join(map(str, command))}): {result.stderr[-3000:]}")
    return result.stdout


def bigmem(*args) -> list[str]:
    return [sys.executable, "-m", "bigmem", *map(str, args)]


def prepare(work: Path, name: str) -> tuple[Path, Path]:
    """The stand-in's nnU-Net raw folder and its bigmem store (made once)."""
    raw = standins.write_dataset(work / "raw" / f"Dataset{DATASET_IDS[name]}_{name}", name, cache=work / "cache")
    store = work / f"{name}.h5"
    if not store.exists():
        run(bigmem("convert", raw, "-o", store), what=f"convert {name}")
    return raw, store


def score(predictions: Path, raw: Path) -> dict:
    """``bigmem evaluate``'s foreground mean Dice and per-class means for a folder of predictions."""
    summary = predictions.parent / f"{predictions.name}-summary.json"
    run(bigmem("evaluate", predictions, raw, "--no-hausdorff", "--allow-missing", "-o", summary), what="evaluate")
    values = json.loads(summary.read_text())
    return {"dice": values["foreground_mean"]["Dice"],
            "dice_per_class": {name: m["Dice"] for name, m in values["mean"].items()}}


def finish(folder: Path, result: dict) -> dict:
    tmp = folder / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.rename(folder / "result.json")
    return result


def bigmem_run(work: Path, name: str, arm: str, steps: int, seed: int, precision: str) -> dict:
    folder = work / name / arm / str(steps) / f"seed{seed}"
    if (folder / "result.json").exists():
        return json.loads((folder / "result.json").read_text())
    raw, store = prepare(work, name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = bigmem("train", "--model", "small", "--data", store, "--steps", steps, "--seed", seed, "--precision",
                     precision, "--monitor-interval", "0", "--checkpoint-every", steps, "--out", folder / "run",
                     *ARMS[arm])
    run(command, what=f"{name} {arm} {steps} steps")
    summary = json.loads((folder / "run" / "summary.json").read_text())
    config = json.loads((folder / "run" / "config.json").read_text())
    for split in ("Ts", "Tr"):
        run(bigmem("predict", folder / "run", raw / f"images{split}", "-o", folder / f"pred{split}"),
            what=f"predict {split}")
    return finish(folder, {"tool": "bigmem", "standin": name, "arm": arm, "budget_steps": steps, "seed": seed,
                           "precision": precision, "command": " ".join(map(str, command[2:])),
                           "train_s": summary["train_s"], "final_loss": summary["loss"],
                           "recipe": config["train"]["recipe"], "augment": config["data"]["augment"],
                           "unseen": score(folder / "predTs", raw), "train": score(folder / "predTr", raw)})


def nnunet_env(work: Path, python: Path, epochs: int, iterations: int) -> dict:
    return {"nnUNet_raw": str(work / "raw"), "nnUNet_preprocessed": str(work / "nnunet_preprocessed"),
            "nnUNet_results": str(work / "nnunet_results"), "BUDGET_EPOCHS": str(epochs),
            "BUDGET_ITERATIONS": str(iterations), "BUDGET_VAL_ITERATIONS": str(max(1, iterations // 5)),
            "PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}"}


def nnunet_prepare(work: Path, name: str, python: Path) -> None:
    """Installs the budget trainer in the nnU-Net venv and plans and preprocesses the stand-in (once)."""
    package = Path(run([str(python), "-c", "import nnunetv2, os; print(os.path.dirname(nnunetv2.__file__))"],
                       what="find nnunetv2").strip())
    trainer = package / "training" / "nnUNetTrainer" / "variants" / f"{NNUNET_TRAINER}.py"
    if not trainer.exists() or trainer.read_text() != TRAINER_SOURCE:
        trainer.write_text(TRAINER_SOURCE)
    prepare(work, name)
    dataset = DATASET_IDS[name]
    if not list((work / "nnunet_preprocessed").glob(f"Dataset{dataset}_*/nnUNetPlans_3d_fullres")):
        run(["nnUNetv2_plan_and_preprocess", "-d", str(dataset), "-c", "3d_fullres", "-np", "2", "-npfp", "2",
             "--verify_dataset_integrity"], env=nnunet_env(work, python, 1, 1), what="nnU-Net plan_and_preprocess")


def nnunet_train(work: Path, name: str, python: Path, epochs: int, iterations: int) -> float:
    """Trains nnU-Net's budget trainer; its training seconds."""
    out = run([str(python), "-c", NNUNET_TRAIN, str(DATASET_IDS[name])],
              env=nnunet_env(work, python, epochs, iterations), what="nnU-Net train")
    return float(re.search(r"TRAIN_S ([0-9.]+)", out).group(1))


def nnunet_seconds_per_iteration(work: Path, name: str, python: Path) -> float:
    """nnU-Net's training seconds per iteration on this CPU, validation share included (measured once)."""
    path = work / name / "nnunet" / "calibration.json"
    if path.exists():
        return json.loads(path.read_text())["seconds_per_iteration"]
    path.parent.mkdir(parents=True, exist_ok=True)
    short = nnunet_train(work, name, python, 1, 5)
    longer = nnunet_train(work, name, python, 1, 25)
    rate = (longer - short) / 20  # the start-up cancels
    path.write_text(json.dumps({"seconds_per_iteration": rate, "train_s_5": short, "train_s_25": longer}))
    return rate


def nnunet_run(work: Path, name: str, python: Path, budget_steps: int, budget_s: float) -> dict:
    folder = work / name / "nnunet" / str(budget_steps) / "seed0"
    if (folder / "result.json").exists():
        return json.loads((folder / "result.json").read_text())
    nnunet_prepare(work, name, python)
    rate = nnunet_seconds_per_iteration(work, name, python)
    total = max(NNUNET_MIN_EPOCHS, round(budget_s / rate))
    epochs = max(NNUNET_MIN_EPOCHS, round(total / NNUNET_ITERATIONS_PER_EPOCH))
    iterations = max(1, round(total / epochs))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    train_s = nnunet_train(work, name, python, epochs, iterations)
    raw = work / "raw" / f"Dataset{DATASET_IDS[name]}_{name}"
    env = nnunet_env(work, python, epochs, iterations)
    for split in ("Ts", "Tr"):
        run(["nnUNetv2_predict", "-i", str(raw / f"images{split}"), "-o", str(folder / f"pred{split}"), "-d",
             str(DATASET_IDS[name]), "-c", "3d_fullres", "-f", "all", "-tr", NNUNET_TRAINER, "--disable_tta",
             "-device", "cpu", "-npp", "0", "-nps", "0"], env=env, what=f"nnU-Net predict {split}")
        for extra in (folder / f"pred{split}").glob("*.json"):
            extra.unlink()  # dataset.json, plans.json, predict_from_raw_data_args.json: not predictions
    return finish(folder, {"tool": "nnunet", "standin": name, "arm": "nnunet", "budget_steps": budget_steps,
                           "seed": 0, "precision": "fp32", "budget_s": budget_s, "epochs": epochs,
                           "iterations_per_epoch": iterations, "seconds_per_iteration": rate, "train_s": train_s,
                           "unseen": score(folder / "predTs", raw), "train": score(folder / "predTr", raw)})


def results(work: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(work.glob("*/*/*/seed*/result.json"))]


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["standin"], row["arm"], row["budget_steps"]), []).append(row)
    summary = []
    for (name, arm, steps), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        unseen = [r["unseen"]["dice"] for r in runs]
        train = [r["train"]["dice"] for r in runs]
        summary.append({"standin": name, "arm": arm, "budget_steps": steps, "seeds": len(runs),
                        "unseen": statistics.mean(unseen), "unseen_min": min(unseen), "unseen_max": max(unseen),
                        "train": statistics.mean(train), "gap": statistics.mean(train) - statistics.mean(unseen),
                        "train_s": statistics.mean(r["train_s"] for r in runs),
                        "precision": runs[0]["precision"]})
    return summary


def table(summary: list[dict]) -> str:
    lines = ["| stand-in | budget (steps) | arm | seeds | train s | unseen Dice (min-max) | training Dice | gap |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['standin']} | {s['budget_steps']} | {s['arm']} | {s['seeds']} | {s['train_s']:.0f} | "
                     f"{s['unseen']:.3f} ({s['unseen_min']:.3f}-{s['unseen_max']:.3f}) | {s['train']:.3f} | "
                     f"{s['gap']:.3f} |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({s["standin"] for s in summary})
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for axis, name in zip(axes[0], names):
        for arm in [a for a in [*ARMS, "nnunet"] if any(s["arm"] == a and s["standin"] == name for s in summary)]:
            mine = [s for s in summary if s["arm"] == arm and s["standin"] == name]
            points = sorted((s["train_s"] / 3600, s["unseen"]) for s in mine)
            axis.plot(*zip(*points), marker="o", label=arm)
        axis.set(title=name, xlabel="training time (hours)", ylabel="unseen-subject Dice", xscale="log")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def write_outputs(work: Path, out: Path, args) -> None:
    from _results import machine_slug

    from bigmem.sysinfo import collect_sysinfo

    rows = results(work)
    if not rows:
        return
    summary = summarise(rows)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"recipe_budget-{machine_slug()}"
    report = {"machine": collect_sysinfo(include_tensorflow=False), "command": command_line(__file__),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "summary": summary, "runs": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(table(summary) + "\n")
    plot(summary, stem.with_suffix(".png"))
    print(table(summary))
    print(f"wrote {stem}.json, .md, .png")


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"budgets": [4], "ablation_budgets": [], "arms": ["recipe"],
                                          "standins": ["organs"]})
    parser.add_argument("--standins", nargs="+", default=["brain", "organs"], choices=sorted(DATASET_IDS))
    parser.add_argument("--budgets", type=int, nargs="+", default=[300, 600, 1200, 2400, 4800])
    parser.add_argument("--arms", nargs="+", default=list(MAIN_ARMS), choices=sorted(ARMS))
    parser.add_argument("--ablation-budgets", type=int, nargs="*", default=[300],
                        help="the budgets every arm of ARMS runs at (default 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--nnunet-python", type=Path, help="the python of a venv with nnunetv2 (default: no nnU-Net)")
    parser.add_argument("--work", type=Path, default=Path("study-work"),
                        help="runs and stand-ins (default ./study-work)")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    plan = [(name, arm, steps) for name in args.standins for steps in args.budgets for arm in args.arms]
    plan += [(name, arm, steps) for name in args.standins for steps in args.ablation_budgets for arm in ARMS
             if (name, arm, steps) not in plan]
    try:
        for name, arm, steps in plan:
            for seed in args.seeds:
                started = time.perf_counter()
                row = bigmem_run(work, name, arm, steps, seed, args.precision)
                print(f"{name} {arm} {steps} seed {seed}: unseen {row['unseen']['dice']:.3f}, training "
                      f"{row['train']['dice']:.3f}, {row['train_s']:.0f} s train "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
            if args.nnunet_python and arm == DEFAULT_ARM:
                budget = json.loads((work / name / arm / str(steps) / "seed0" / "result.json").read_text())
                row = nnunet_run(work, name, args.nnunet_python, steps, budget["train_s"])
                print(f"{name} nnunet {steps}: unseen {row['unseen']['dice']:.3f} ({row['train_s']:.0f} s)", flush=True)
    finally:
        write_outputs(work, Path(args.out), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
