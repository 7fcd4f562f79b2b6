"""Does the network ``bigmem plan --data`` configures beat a fixed preset on anisotropic CT? And do fold ensembles help?

    python benchmarks/proofs/bench_planned_topology.py [--steps 60] [--seeds 0 1 2] [--train-cases 12]
        [--test-cases 6] [--inplane 64] [--slices 16 40] [--coarse-axis 2] [--phases A B O] [--quick] [--out DIR]

A KiTS-like stand-in: CT-like scans at 0.8 x 0.8 x 3 mm with a varied number of slices. One smooth
template at 0.8 mm isotropic (a kidney-like ellipsoid in perirenal fat, a tumour-like blob inside it
and partly out of it: classes background / kidney / tumour, in HU) is warped into subjects, each by
its own pose (rotation up to ``--max-rotation`` degrees), scale (0.85-1.15), smooth deformation
(~3 mm) and intensity (enhancement, offset, noise), and sampled onto a grid of ``--inplane`` voxels of
0.8 mm in plane and ``--slices`` (a range: a per-case count) slices of 3 mm along ``--coarse-axis``:
each slice averages four sub-slices (partial volume), its label is the centre's. The slab's centre
moves per case, so short scans cut the kidney as real short scans do. ``--coarse-axis 2`` (default)
puts the slices where a NIfTI axial scan puts them in a bigmem store (its last, canonical RAS, axis);
``0`` the first. Training cases go to train.h5, unseen cases to test.h5 (StoreWriter, CT normalisation
chosen as ``bigmem convert`` chooses it).

Phase A (topology): per seed, at equal ``--steps`` and the same batch (the plan's), (1) the planned
network: ``bigmem plan --data train.h5 --out DIR/plan.json`` then ``bigmem train --plan
DIR/experiment.toml``; (2) ``bigmem train --model kits19`` on the same store (each case padded to a
multiple of 32). Per run: padding share per epoch, median step and epoch seconds (metrics.jsonl),
and Dice on the unseen cases (``bigmem predict RUN test.h5`` then ``bigmem evaluate OUT test.h5``).
Phase B (ensemble): the planned network on a 2-fold split of the training cases (``--fold 0/1
--splits``), one seed; Dice on the unseen cases of fold 0, fold 1 and ``bigmem predict RUN0 RUN1``.

Every run trains with ``--no-tune`` (the shipped kernel tables, no tuning pass) and ``--monitor-interval 0``.
Each first waits (polling every 20 s, up to ``--max-wait`` s, all waits together up to ``--max-total-wait``)
for the 1-minute load average to fall under ``--max-load``; the load at its start and end is in the JSON.
``--coarse-axis``'s other axis is checked too (phase O): planned (the same network, axes swapped?) and run
2 steps, predicted and evaluated. Never run by pytest.
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

TEMPLATE_SEED = 23
FINE_MM = 0.8  # the template's isotropic grid
INPLANE_MM = 0.8
SLICE_MM = 3.0
SUBSLICES = 4  # samples averaged across one 3 mm slice (partial volume)
LABEL_NAMES = ["background", "kidney", "tumor"]


# ---- the stand-in data ---------------------------------------------------------------------------


def _rotation(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rodrigues' rotation matrix about unit ``axis``."""
    axis = axis / np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def template(extent_mm: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The smooth template on a 0.8 mm grid centred on the origin (x, y, z; z the body's long axis): HU and labels.

    Soft tissue (~40 HU, a smooth texture), a fat shell (-90 HU) around a kidney-like ellipsoid
    (semi-axes 17 x 13 x 30 mm, enhancing cortex ~190 HU over a ~120 HU medulla) and a tumour-like
    blob (radius ~9 mm, ~70 HU, a bumpy surface) off the kidney's centre, partly outside it.
    """
    from scipy import ndimage

    rng = np.random.default_rng(TEMPLATE_SEED)
    shape = tuple(int(math.ceil(e / FINE_MM)) for e in extent_mm)
    x, y, z = np.meshgrid(*[(np.arange(s) - (s - 1) / 2) * FINE_MM for s in shape], indexing="ij", sparse=True)
    smooth = lambda sigma: ndimage.gaussian_filter(rng.normal(size=shape), sigma)  # noqa: E731
    texture = smooth(4.0)
    texture /= np.abs(texture).max()
    kidney_r = np.sqrt((x / 17.0) ** 2 + (y / 13.0) ** 2 + (z / 30.0) ** 2)
    bump = smooth(3.0)
    bump /= np.abs(bump).max()
    tumour_r = np.sqrt((x - 9.0) ** 2 + (y + 4.0) ** 2 + (z - 8.0) ** 2) / 9.0 + 0.15 * bump
    label = np.zeros(shape, np.uint8)
    label[kidney_r <= 1.0] = 1
    label[tumour_r <= 1.0] = 2
    image = 40.0 + 15.0 * texture
    image = np.where(kidney_r <= 1.35, -90.0 + 10.0 * texture, image)  # perirenal fat
    image = np.where(kidney_r <= 1.0, 120.0 + 70.0 * np.clip((kidney_r - 0.55) / 0.3, 0, 1) + 10 * texture, image)
    image = np.where(tumour_r <= 1.0, 70.0 + 20.0 * texture, image)
    image = ndimage.gaussian_filter(image, 0.6)  # no voxel-sharp edges on the fine grid
    return image.astype(np.float32), label


def subject(image: np.ndarray, label: np.ndarray, rng: np.random.Generator, *, inplane: int, slices: int,
            max_rotation_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """One subject's scan (x, y, z; z the 3 mm axis, ``slices`` long): the template under its own pose, scale,
    deformation, slab position and intensity, each slice the mean of ``SUBSLICES`` samples across it."""
    from scipy import ndimage

    fine = np.asarray(image.shape)
    centre = (fine - 1) / 2
    inverse = _rotation(rng.normal(size=3), math.radians(rng.uniform(-max_rotation_deg, max_rotation_deg))).T
    inverse = inverse / rng.uniform(0.85, 1.15)
    shift = rng.uniform(-4, 4, 3)  # mm: the kidney off the field's centre
    shift[2] = rng.uniform(-0.25, 0.25) * slices * SLICE_MM  # the slab along the body: short scans cut the kidney
    field = rng.normal(size=(3, 5, 5, 5))  # a displacement per axis on a 5^3 grid over the template, cubic between
    field = 3.0 * field / np.abs(field).max(axis=(1, 2, 3), keepdims=True)  # mm
    xs = (np.arange(inplane) - (inplane - 1) / 2) * INPLANE_MM
    zs = (np.arange(slices) - (slices - 1) / 2) * SLICE_MM
    offsets = ((np.arange(SUBSLICES) + 0.5) / SUBSLICES - 0.5) * SLICE_MM
    grid = np.stack(np.meshgrid(xs, xs, zs, indexing="ij"))  # (3, X, Y, Z) mm in the subject's frame

    points = grid - shift[:, None, None, None]
    index = np.einsum("ij,j...->i...", inverse, points) / FINE_MM + centre[:, None, None, None]
    coarse = index * ((np.asarray(field.shape[1:]) - 1) / (fine - 1))[:, None, None, None]
    warp = np.stack([ndimage.map_coordinates(f, coarse, order=3, mode="nearest") for f in field]) / FINE_MM
    index = index + warp  # the deformation, taken at each slice's centre (it varies over ~10 mm, a slice is 3)

    def sample(dz: float, order: int, values: np.ndarray) -> np.ndarray:
        return ndimage.map_coordinates(values, index + (inverse[:, 2] * dz / FINE_MM)[:, None, None, None],
                                       order=order, mode="nearest")

    hu = np.mean([sample(dz, 1, image) for dz in offsets], axis=0)
    labels = sample(0.0, 0, label).astype(np.uint8)
    enhancement = rng.uniform(0.85, 1.15)  # contrast phase: enhancing voxels scale about soft tissue
    hu = 40.0 + (hu - 40.0) * np.where(hu > 40.0, enhancement, 1.0) + rng.uniform(-10, 10)
    hu = hu + rng.normal(0, rng.uniform(12, 22), hu.shape)
    return np.round(hu).astype(np.float32), labels


def write_stores(folder: Path, *, train_cases: int, test_cases: int, inplane: int, slices: tuple[int, int],
                 coarse_axis: int, max_rotation_deg: float, seed: int = 0) -> tuple[Path, Path, list[dict]]:
    """train.h5 and test.h5 (``coarse_axis`` the 3 mm one), the test cases' ids after the training ones'."""
    from bigmem.data.preprocess import PREPROCESSING_ATTR, case_statistics, choose_schemes, foreground_sample
    from bigmem.data.store import StoreWriter

    extent = (inplane * INPLANE_MM + 20.0, inplane * INPLANE_MM + 20.0, slices[1] * SLICE_MM + 60.0)
    image, label = template(extent)
    rng = np.random.default_rng([seed, 1])
    counts = rng.integers(slices[0], slices[1] + 1, train_cases + test_cases)
    cases, made = [], []
    for index, count in enumerate(counts):
        hu, lab = subject(image, label, np.random.default_rng([seed, 2, index]), inplane=inplane,
                          slices=int(count), max_rotation_deg=max_rotation_deg)
        hu, lab = np.moveaxis(hu, 2, coarse_axis), np.moveaxis(lab, 2, coarse_axis)
        spacing = [INPLANE_MM, INPLANE_MM]
        spacing.insert(coarse_axis, SLICE_MM)
        made.append((f"case_{index:05d}", hu, lab, tuple(spacing)))
        cases.append({"case": f"case_{index:05d}", "shape": list(lab.shape), "spacing": spacing,
                      "split": "train" if index < train_cases else "test",
                      "voxels": {name: int((lab == k).sum()) for k, name in enumerate(LABEL_NAMES)}})
    # CT normalisation as convert chooses it for a channel named CT, from the training cases' foreground.
    train = made[:train_cases]
    preprocessing = choose_schemes(["CT"], [case_statistics(h[..., None]) for _, h, _, _ in train],
                                   [foreground_sample(h[..., None], lab) for _, h, lab, _ in train])
    paths = []
    for name, group in (("train.h5", train), ("test.h5", made[train_cases:])):
        with StoreWriter(folder / name, num_classes=3, channel_names=["CT"], label_names=LABEL_NAMES) as writer:
            for case_id, hu, lab, spacing in group:
                writer.add_case(case_id, hu[..., None], lab, spacing=spacing, affine=np.diag([*spacing, 1.0]),
                                source_image=f"stand-in:{case_id}",
                                foreground=foreground_sample(hu[..., None], lab))
            writer.set_root_attr(PREPROCESSING_ATTR, preprocessing.to_json())
            paths.append(writer.commit())
    return paths[0], paths[1], cases


# ---- running bigmem, one job at a time ------------------------------------------------------------


def load_average() -> float:
    """The 1-minute load average (/proc/loadavg)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


WAITED = {"s": 0.0}  # seconds every wait so far took: --max-total-wait caps their sum


def wait_for_quiet(max_load: float, max_wait_s: float, say, poll_s: float = 20.0, total_s: float = math.inf) -> dict:
    """Poll every ``poll_s`` until the 1-minute load is under ``max_load`` (at most ``max_wait_s``, and at most what
    is left of ``total_s`` over every wait): what was seen."""
    first = load = load_average()
    started = time.monotonic()
    limit = min(max_wait_s, max(0.0, total_s - WAITED["s"]))
    while load >= max_load and time.monotonic() - started < limit:
        say(f"  load {load:.2f} >= {max_load}: waiting ({time.monotonic() - started:.0f} s so far)")
        time.sleep(poll_s)
        load = load_average()
    WAITED["s"] += time.monotonic() - started
    return {"load_before_wait": first, "waited_s": round(time.monotonic() - started, 1), "load_start": load,
            "quiet": load < max_load}


def bigmem(args: list, say, what: str) -> dict:
    """``python -m bigmem ARGS``: its exit status, wall seconds, the tail of its output (never raises)."""
    command = [sys.executable, "-m", "bigmem", *map(str, args)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    record = {"command": "bigmem " + " ".join(map(str, args)), "rc": result.returncode,
              "wall_s": round(time.perf_counter() - started, 2), "stdout_tail": result.stdout[-3000:]}
    if result.returncode:
        record["stderr_tail"] = result.stderr[-3000:]
        say(f"  [red]{what} failed (exit {result.returncode})[/red]: {record['command']}\n"
            + "\n".join(result.stderr.strip().splitlines()[-5:]))
    return record


def step_figures(run: Path, steps_per_epoch: int) -> dict:
    """From metrics.jsonl: the median step (all, and without each shape's first, compiling, step) and epoch seconds."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r]
    seen, steady = set(), []
    for row in rows:
        shape = tuple(row.get("shape") or ())
        if shape in seen:
            steady.append(row["step_s"])
        seen.add(shape)
    epochs = [sum(r["step_s"] for r in rows[i:i + steps_per_epoch])
              for i in range(0, len(rows) - steps_per_epoch + 1, steps_per_epoch)]
    return {"steps_logged": len(rows), "median_step_s": statistics.median(r["step_s"] for r in rows) if rows else None,
            "median_steady_step_s": statistics.median(steady) if steady else None,
            "epoch_s": epochs, "first_epoch_s": epochs[0] if epochs else None,
            "median_later_epoch_s": statistics.median(epochs[1:]) if len(epochs) > 1 else None,
            "input_wait_s": sum(r.get("input_wait_s", 0.0) for r in rows)}


def dice_of(summary_path: Path) -> dict:
    """Per-class and mean foreground Dice from ``bigmem evaluate``'s summary.json."""
    summary = json.loads(summary_path.read_text())
    per_class = {str(k): v.get("Dice") for k, v in summary.get("mean", {}).items()}
    per_case = {c["case_id"]: {k: m.get("Dice") for k, m in c["metrics"].items()}
                for c in summary.get("metric_per_case", [])}
    hd95 = {str(k): v.get("HD95_mm") for k, v in summary.get("mean", {}).items()}
    return {"per_class": per_class, "foreground_mean": summary.get("foreground_mean", {}).get("Dice"),
            "hd95_mm": hd95, "per_case": per_case, "cases": len(per_case)}


def score(runs: list[Path], test: Path, out: Path, say, what: str) -> dict:
    """``bigmem predict RUN... test.h5 -o OUT``, then ``bigmem evaluate OUT test.h5``: Dice, and both commands."""
    predicted = bigmem(["predict", *runs, test, "-o", out], say, f"predict {what}")
    record = {"predict": predicted}
    if predicted["rc"] == 0:
        record["evaluate"] = bigmem(["evaluate", out, test, "-o", out / "summary.json"], say, f"evaluate {what}")
        if record["evaluate"]["rc"] == 0:
            record["dice"] = dice_of(out / "summary.json")
    return record


def train_and_score(label: str, config_args: list, *, store: Path, test: Path, folder: Path, seed: int, steps: int,
                    batch: int, steps_per_epoch: int, extra: list, args, say) -> dict:
    """One timed training run (after the load settles), then its Dice on the unseen cases."""
    run = folder / f"{label}-seed{seed}"
    quiet = wait_for_quiet(args.max_load, args.max_wait, say, total_s=args.max_total_wait)
    say(f"{label}, seed {seed}: training {steps} steps (load {quiet['load_start']:.2f}) ...")
    trained = bigmem(["train", *config_args, "--data", store, "--steps", steps, "--batch-size", batch, "--seed", seed,
                      "--monitor-interval", 0, "--checkpoint-every", steps, "--no-tune", "--out", run, *extra],
                     say, f"train {label}")
    record = {"config": label, "seed": seed, "run": run.name, "train": trained, **quiet, "load_end": load_average()}
    if trained["rc"]:
        return record
    summary = json.loads((run / "summary.json").read_text())
    record.update({"padding_share_per_epoch": summary.get("padding_share_per_epoch"),
                   "steps_per_shape": summary.get("steps_per_shape"), "compile_s": summary.get("compile_s"),
                   "train_s": summary.get("train_s"), "final_loss": summary.get("loss"),
                   "peak_rss_bytes": summary.get("peak_rss_bytes"),
                   "header": next((line for line in trained["stdout_tail"].splitlines()
                                   if line.startswith("bigmem train:")), None),
                   **step_figures(run, steps_per_epoch)})
    record["score"] = score([run], test, folder / f"pred-{run.name}", say, f"{label} seed {seed}")
    record["dice"] = record["score"].get("dice")
    dice = record["dice"]["foreground_mean"] if record["dice"] else float("nan")
    say(f"  padding {100 * (record['padding_share_per_epoch'] or [float('nan')])[0]:.1f}%, "
        f"steady step {record['median_steady_step_s'] or float('nan'):.2f} s, unseen Dice {dice:.4f} "
        f"({trained['wall_s']:.0f} s; load {quiet['load_start']:.2f} -> {record['load_end']:.2f})")
    return record


def topology_of(plan_json: Path) -> dict:
    """The configured network's figures from plan.json (``experiment``) and its chosen step."""
    plan = json.loads(plan_json.read_text())
    experiment = plan.get("experiment") or {}
    chosen = plan.get("chosen") or {}
    return {key: experiment.get(key) for key in ("target_spacing", "median_shape", "padded_median_shape", "stages",
                                                  "kernel_sizes", "strides", "features", "divisors")} | {
        "batch_size": chosen.get("batch_size"), "predicted_step_s": chosen.get("predicted_step_s"),
        "predicted_peak_bytes": plan.get("predicted_peak_bytes"), "batch_cap": plan.get("batch_cap"),
        "cases": [(c["case"], c["shape"], c["padded_shape"]) for c in plan.get("cases", [])]}


def padding_of(cases: list) -> float:
    """The padding share of every case whole at its padded shape, batch 1 (plan.json's cases)."""
    real = sum(math.prod(shape) for _, shape, _ in cases)
    fed = sum(math.prod(padded) for _, _, padded in cases)
    return 1.0 - real / fed if fed else float("nan")


def mean_spread(values: list) -> dict:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"n": 0, "mean": None, "min": None, "max": None, "stdev": None}
    return {"n": len(values), "mean": statistics.mean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else None}


def fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


# ---- the benchmark --------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"steps": 2, "seeds": [0], "train_cases": 4, "test_cases": 2,
                                          "inplane": 32, "slices": [8, 14], "max_wait": 0})
    parser.add_argument("--steps", type=int, default=60, help="training steps of every run (default 60)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-cases", type=int, default=12)
    parser.add_argument("--test-cases", type=int, default=6)
    parser.add_argument("--inplane", type=int, default=64, help="in-plane voxels per axis, 0.8 mm each (default 64)")
    parser.add_argument("--slices", type=int, nargs=2, default=[16, 40], metavar=("MIN", "MAX"),
                        help="per-case number of 3 mm slices, drawn in [MIN, MAX] (default 16 40)")
    parser.add_argument("--coarse-axis", type=int, choices=(0, 2), default=2,
                        help="the store's array axis of the 3 mm slices (default 2, as a NIfTI axial scan)")
    parser.add_argument("--max-rotation", type=float, default=15.0, help="degrees of the subjects' pose")
    parser.add_argument("--phases", nargs="+", choices=("A", "B", "O"), default=["A", "B", "O"],
                        help="A: planned vs kits19 over seeds; B: 2-fold ensemble; O: the other coarse axis, "
                             "planned and smoke-run (2 steps, predict, evaluate)")
    parser.add_argument("--max-load", type=float, default=1.5, help="start a timed run under this 1-minute load")
    parser.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for that load at most")
    parser.add_argument("--max-total-wait", type=float, default=900.0,
                        help="seconds all those waits may take together (default 900): then runs start at any load")
    parser.add_argument("--keep", default=None, help="keep the stores and runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.sysinfo import collect_sysinfo

    console = Console(width=140)
    say = console.print
    started = time.perf_counter()
    report = {"machine": collect_sysinfo(include_tensorflow=False), "command": command_line(__file__),
              "settings": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        train, test, cases = write_stores(folder, train_cases=args.train_cases, test_cases=args.test_cases,
                                          inplane=args.inplane, slices=tuple(args.slices),
                                          coarse_axis=args.coarse_axis, max_rotation_deg=args.max_rotation)
        report["cases"] = cases
        say(f"{args.train_cases} training + {args.test_cases} unseen cases, {args.inplane}x{args.inplane} at 0.8 mm, "
            f"{args.slices[0]}..{args.slices[1]} slices of 3 mm on axis {args.coarse_axis}: "
            + ", ".join("x".join(map(str, c["shape"])) for c in cases))
        plans = {}
        planned = bigmem(["plan", "--data", train, "--out", folder / "plan" / "plan.json"], say, "plan")
        report["plan"] = planned
        if planned["rc"]:
            write_results("planned_topology", report, args.out, console)
            return 1
        plans["planned"] = topology_of(folder / "plan" / "plan.json")
        batch = plans["planned"]["batch_size"] or 2
        kits = bigmem(["plan", "--data", train, "--model", "kits19", "--batch-size", batch, "--out",
                       folder / "plan-kits19" / "plan.json"], say, "plan kits19")
        report["plan_kits19"] = kits
        if kits["rc"] == 0:
            plans["kits19"] = topology_of(folder / "plan-kits19" / "plan.json")
        for plan in plans.values():
            plan["padding_share_batch1"] = padding_of(plan["cases"])
        report["plans"] = plans
        p = plans["planned"]
        say(f"planned: {p['stages']} stages, kernels {p['kernel_sizes']}, strides {p['strides']}, divisors "
            f"{p['divisors']}, batch {batch} (cap {p['batch_cap']}), predicted step {p['predicted_step_s']} s")
        steps_per_epoch = -(-args.train_cases // batch)
        configs = {"planned": ["--plan", folder / "plan" / "experiment.toml"], "kits19": ["--model", "kits19"]}

        if "A" in args.phases:
            runs = []
            for seed in args.seeds:
                for label, config_args in configs.items():
                    runs.append(train_and_score(label, config_args, store=train, test=test, folder=folder,
                                                seed=seed, steps=args.steps, batch=batch,
                                                steps_per_epoch=steps_per_epoch, extra=[], args=args, say=say))
            report["phase_a"] = {"runs": runs, "summary": []}
            table = Table(title=f"Phase A: unseen-case Dice ({args.test_cases} cases), {args.steps} steps, batch "
                                f"{batch}, {len(args.seeds)} seed(s), trained on {args.train_cases}")
            for column in ("config", "padding share", "step s (median, steady)", "epoch s (median)", "Dice kidney",
                           "Dice tumour", "Dice mean fg", "min..max", "failed"):
                table.add_column(column, justify="right")
            for label in configs:
                mine = [r for r in runs if r["config"] == label]
                ok = [r for r in mine if r.get("dice")]
                row = {"config": label, "runs": len(mine), "failed": len(mine) - len(ok),
                       "padding_share": mean_spread([r["padding_share_per_epoch"][0] for r in ok
                                                     if r.get("padding_share_per_epoch")]),
                       "median_steady_step_s": mean_spread([r["median_steady_step_s"] for r in ok]),
                       "median_later_epoch_s": mean_spread([r["median_later_epoch_s"] for r in ok]),
                       "dice_kidney": mean_spread([r["dice"]["per_class"].get("1") for r in ok]),
                       "dice_tumor": mean_spread([r["dice"]["per_class"].get("2") for r in ok]),
                       "dice_mean": mean_spread([r["dice"]["foreground_mean"] for r in ok])}
                report["phase_a"]["summary"].append(row)
                table.add_row(label, fmt(row["padding_share"]["mean"], ".1%"),
                              fmt(row["median_steady_step_s"]["mean"], ".2f"),
                              fmt(row["median_later_epoch_s"]["mean"], ".1f"),
                              fmt(row["dice_kidney"]["mean"]), fmt(row["dice_tumor"]["mean"]),
                              f"{fmt(row['dice_mean']['mean'])} ± {fmt(row['dice_mean']['stdev'])}",
                              f"{fmt(row['dice_mean']['min'])}..{fmt(row['dice_mean']['max'])}", str(row["failed"]))
            say(table)

        if "B" in args.phases:
            ids = sorted(c["case"] for c in cases if c["split"] == "train")
            folds = [ids[0::2], ids[1::2]]
            splits = [{"train": folds[1 - k], "val": folds[k]} for k in range(2)]
            (folder / "splits_final.json").write_text(json.dumps(splits, indent=1))
            seed = args.seeds[0]
            fold_runs = []
            fold_steps_per_epoch = -(-len(folds[1]) // batch)
            for k in range(2):
                fold_runs.append(train_and_score(f"planned-fold{k}", configs["planned"], store=train, test=test,
                                                 folder=folder, seed=seed, steps=args.steps, batch=batch,
                                                 steps_per_epoch=fold_steps_per_epoch,
                                                 extra=["--fold", k, "--splits", folder / "splits_final.json"],
                                                 args=args, say=say))
            members = [folder / f"{r['run']}" for r in fold_runs if r["train"]["rc"] == 0]
            ensemble = {"members": [m.name for m in members]}
            if len(members) == 2:
                ensemble["score"] = score(members, test, folder / "pred-ensemble", say, "ensemble")
                ensemble["dice"] = ensemble["score"].get("dice")
            report["phase_b"] = {"splits": splits, "seed": seed, "runs": fold_runs, "ensemble": ensemble}
            table = Table(title=f"Phase B: planned network, 2 folds of {args.train_cases} (each trains on "
                                f"{len(folds[0])}), {args.steps} steps, seed {seed}; Dice on {args.test_cases} "
                                "unseen cases")
            for column in ("model", "Dice kidney", "Dice tumour", "Dice mean fg"):
                table.add_column(column, justify="right")
            for label, dice in [(r["config"], r.get("dice")) for r in fold_runs] + [("ensemble", ensemble.get("dice"))]:
                dice = dice or {"per_class": {}, "foreground_mean": None}
                table.add_row(label, fmt(dice["per_class"].get("1")), fmt(dice["per_class"].get("2")),
                              fmt(dice["foreground_mean"]))
            say(table)

        if "O" in args.phases:
            other = 2 - args.coarse_axis
            flipped = folder / f"axis{other}"
            flipped.mkdir(exist_ok=True)
            train_o, test_o, _ = write_stores(flipped, train_cases=args.train_cases, test_cases=args.test_cases,
                                              inplane=args.inplane, slices=tuple(args.slices), coarse_axis=other,
                                              max_rotation_deg=args.max_rotation)
            check = {"coarse_axis": other, "plan": bigmem(["plan", "--data", train_o, "--out",
                                                           flipped / "plan" / "plan.json"], say, "plan (other axis)")}
            if check["plan"]["rc"] == 0:
                check["topology"] = topology_of(flipped / "plan" / "plan.json")
                mine = plans["planned"]  # axes 0 and 2 swapped: each triple reversed
                check["same_network_axes_swapped"] = all(
                    [list(reversed(t)) for t in check["topology"][key]] == [list(t) for t in mine[key]]
                    for key in ("kernel_sizes", "strides")) and list(reversed(check["topology"]["divisors"])) == list(
                    mine["divisors"])
                smoke = bigmem(["train", "--plan", flipped / "plan" / "experiment.toml", "--data", train_o,
                                "--steps", 2, "--batch-size", batch, "--monitor-interval", 0, "--no-tune",
                                "--out", flipped / "run"],
                               say, "train (other axis)")
                check["train"] = smoke
                if smoke["rc"] == 0:
                    check["score"] = score([flipped / "run"], test_o, flipped / "pred", say, "other axis")
                say(f"other coarse axis ({other}): kernels {check['topology']['kernel_sizes']}, strides "
                    f"{check['topology']['strides']}; the same network with axes 0 and 2 swapped: "
                    f"{check['same_network_axes_swapped']}; 2-step train, predict, evaluate: "
                    + ("ok" if check.get("score", {}).get("dice") else "FAILED"))
            report["other_axis"] = check
    report["total_wall_s"] = round(time.perf_counter() - started, 1)
    say(f"total {report['total_wall_s'] / 60:.1f} min")
    write_results("planned_topology", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
