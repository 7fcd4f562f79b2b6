"""Whole-volume prediction against sliding windows, and bigmem's sliding window against MONAI's.

    python benchmarks/performance/bench_predict.py [--run RUN_DIR] [--windows 48,24,16] [--overlap 0.5]
        [--monai-window 24] [--train-steps 600] [--quick] [--out benchmarks/results]

Without --run it first trains the `make demo` configuration (the small preset on the embedded
synthetic phantoms, 48^3, ``--train-steps`` steps) with the last 4 cases held out and validated at the end, so the
trainer's own val_dice is known. Then, in a fresh process per configuration (so each peak RSS
is its own), it segments the held-out cases with ``bigmem.infer.predict``:

- ``whole``: one pass over each whole volume, with and without --tta;
- ``sliding``: Gaussian-weighted windows at each --windows edge (overlap 0.5), with and without
  --tta. A window as large as the volume is one window; smaller ones are the patches a GPU tool
  slides (for a volume k times the window, 0.5 overlap runs (2k-1)^3 windows: (2k-1)^3 / k^3
  times the voxels of one whole pass, 3.4x at k=2, 4.6x at k=3, towards 8x).

and scores each with ``bigmem.infer.evaluate`` against the store's labels: foreground Dice,
seconds per case (median, the first case's model warm-up excluded) and peak RSS.

MONAI (the bench extra: ``pip install -e '.[bench]'``): ``monai.inferers.sliding_window_inference``
(mode gaussian, sigma_scale 0.125, the same window and overlap) with the Keras model wrapped as
its predictor, against ``bigmem.infer.sliding.sliding_window`` on one held-out case: the largest
absolute difference of the probabilities. Prints a table and writes JSON (never run by pytest).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, run_command, run_function, spread, write_results
from rich.console import Console
from rich.table import Table

HOLDOUT = 4


def child_predict(request: dict) -> dict:
    """Segment the held-out cases in this (fresh) process; per-case seconds and peak RSS."""
    from bigmem.infer.predict import Mode, find_inputs, load_predictor, predict_case

    predictor = load_predictor(request["run"])
    inputs = find_inputs(request["store"], predictor.config.data.store, cases=request["cases"])
    mode = Mode(request["mode"])
    kwargs = dict(mode=mode, window=request["window"], overlap=request["overlap"], tta=request["tta"])
    out = Path(request["out"])
    out.mkdir(parents=True, exist_ok=True)
    predict_case(predictor, inputs[0], out, **kwargs)  # warm-up: oneDNN primitives, Keras's first call
    results = [predict_case(predictor, item, out, **kwargs) for item in inputs]
    return {"seconds": [r.seconds for r in results], "peak_rss_bytes": [r.peak_rss_bytes for r in results]}


def child_monai(request: dict) -> dict:
    """bigmem's and MONAI's sliding windows over one case with the same model, window and overlap."""
    import numpy as np

    try:
        import torch
        from monai.inferers import sliding_window_inference
    except ImportError as exc:
        return {"skipped": f"MONAI or PyTorch not installed ({exc}); pip install -e '.[bench]'"}
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.infer.forward import forward_probabilities, normalize_image
    from bigmem.infer.predict import load_predictor
    from bigmem.infer.sliding import sliding_window

    predictor = load_predictor(request["run"])
    with HDF5VolumeStore(request["store"]) as store:
        image = normalize_image(predictor.preparation.preprocessing, store.read_case(request["case"])[0],
                                store.case_stats(request["case"]))[0]
    window, overlap = request["window"], request["overlap"]

    def keras_predict(batch: np.ndarray) -> np.ndarray:
        return forward_probabilities(predictor.model, batch)

    ours = sliding_window(image, keras_predict, window, num_classes=predictor.num_classes, overlap=overlap)

    def monai_predictor(patches: "torch.Tensor") -> "torch.Tensor":  # NCDHW <-> NDHWC around the Keras model
        out = keras_predict(np.ascontiguousarray(patches.permute(0, 2, 3, 4, 1).numpy()))
        return torch.from_numpy(out).permute(0, 4, 1, 2, 3)

    with torch.no_grad():
        theirs = sliding_window_inference(torch.from_numpy(np.ascontiguousarray(image.transpose(3, 0, 1, 2)))[None],
                                          (window,) * 3, 1, monai_predictor, overlap=overlap, mode="gaussian",
                                          sigma_scale=0.125, padding_mode="constant", cval=0.0)
    theirs = theirs[0].permute(1, 2, 3, 0).numpy()
    difference = np.abs(ours - theirs)
    import monai

    return {"monai": monai.__version__, "torch": torch.__version__, "case": request["case"], "window": window,
            "overlap": overlap, "max_abs_difference": float(difference.max()),
            "mean_abs_difference": float(difference.mean()),
            "argmax_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))}


def _child(function, request: dict, timeout_s: float = 3600.0) -> dict:
    """``function(request)`` in a fresh process (so its peak RSS is its own); exits if it fails."""
    run = run_function(function, request, what=function.__name__, timeout_s=timeout_s)
    if not run.ok:
        raise SystemExit(f"{function.__name__} failed: {run.failure()}")
    return run.result


def _train_demo(folder: Path, steps: int, console: Console) -> Path:
    run = folder / "demo"
    console.print(f"training the demo configuration with {HOLDOUT} held-out cases -> {run} ...")
    result = run_command([sys.executable, "-m", "bigmem", "train", "--holdout", HOLDOUT, "--val-every", steps,
                          "--steps", steps, "--out", run], what="bigmem train")
    if not result.ok:
        raise SystemExit(f"training failed: {result.stderr.strip()}")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick={"train_steps": 20, "windows": "24"})
    parser.add_argument("--run", help="a finished run trained with --holdout (default: train the demo)")
    parser.add_argument("--windows", default="48,24,16", help="sliding window edges to compare (default 48,24,16)")
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--monai-window", type=int, default=24)
    parser.add_argument("--train-steps", type=int, default=600, help="steps of the demo run trained without --run "
                        "(default 600, the small preset's, as make demo)")
    args = parser.parse_args(argv)

    from bigmem.infer.evaluate import evaluate
    from bigmem.rundir import RunDir
    from bigmem.sysinfo import collect_sysinfo
    from bigmem.units import format_bytes

    console = Console()
    with tempfile.TemporaryDirectory(prefix="bigmem-bench-predict-") as tmp:
        run = Path(args.run) if args.run else _train_demo(Path(tmp), args.train_steps, console)
        config = RunDir(run).read_config()
        store, holdout = config["data"]["store"], config["data"]["holdout"]
        summary = RunDir(run).read_summary() or {}
        from bigmem.data.store import HDF5VolumeStore

        with HDF5VolumeStore(store, holdout=holdout) as opened:
            cases = list(opened.held_out)
            whole_edge = max((max(c.shape) for c in opened.held_out_cases), default=None)  # whole mode's "window"
        if not cases:
            raise SystemExit(f"{run} was trained without --holdout: nothing held out to predict.")
        configs = [("whole", None, False), ("whole", None, True)]
        configs += [("sliding", int(w), tta) for w in args.windows.split(",") for tta in (False, True)]
        rows = []
        for mode, window, tta in configs:
            name = f"{mode}{window or ''}{'-tta' if tta else ''}"
            out = Path(tmp) / name
            started = time.perf_counter()
            timed = _child(child_predict, {"run": str(run), "store": store, "cases": cases, "mode": mode,
                                       "window": window, "overlap": args.overlap, "tta": tta, "out": str(out)})
            scored = evaluate(out, store, allow_missing=True, hausdorff=False)
            rows.append({"mode": mode, "window": window or whole_edge, "overlap": args.overlap,
                         "tta": tta, "cases": len(cases), "dice": scored["foreground_mean"]["Dice"],
                         "dice_per_class": {str(k): v["Dice"] for k, v in scored["mean"].items()},
                         "seconds_per_case": spread(timed["seconds"]).median,
                         "peak_rss_bytes": max(timed["peak_rss_bytes"]), "wall_s": time.perf_counter() - started})
        monai = _child(child_monai, {"run": str(run), "store": store, "case": cases[0], "window": args.monai_window,
                                 "overlap": args.overlap})

    base = {(r["tta"]): r["seconds_per_case"] for r in rows if r["mode"] == "whole"}
    table = Table(title=f"held-out cases of {run.name}: whole vs sliding (overlap {args.overlap:g})")
    for column in ("mode", "window", "TTA", "Dice", "s/case", "x whole", "peak RSS"):
        table.add_column(column, justify="right")
    for r in rows:
        r["slowdown_vs_whole"] = r["seconds_per_case"] / base[r["tta"]]
        table.add_row(r["mode"], f"{r['window']}^3", "yes" if r["tta"] else "no", f"{r['dice']:.4f}",
                      f"{r['seconds_per_case']:.3f}", f"{r['slowdown_vs_whole']:.2f}",
                      format_bytes(r["peak_rss_bytes"]))
    console.print(table)
    console.print(f"trainer's final val_dice: {summary.get('val_dice')}")
    console.print("MONAI: " + (monai.get("skipped") or f"max |bigmem - MONAI| = {monai['max_abs_difference']:.3g} "
                               f"(mean {monai['mean_abs_difference']:.3g}, argmax agreement "
                               f"{100 * monai['argmax_agreement']:.3f}%) at window {monai['window']}^3"))
    sysinfo = collect_sysinfo()
    write_results("predict", {"sysinfo": sysinfo, "run": str(run), "held_out": cases,
                              "trainer_val_dice": summary.get("val_dice"), "rows": rows, "monai": monai}, args.out,
                  console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
