"""--val-every: the held-out cases through the prediction path; best checkpoint; TensorBoard scalars."""

from __future__ import annotations

import json

import pytest

from bigmem.rundir import read_jsonl
from helpers import run_cli


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    import tensorflow as tf

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor)) if value.HasField("tensor") else value.simple_value
                found.setdefault(value.tag, []).append((event.step, number))
    return found


def test_validation_rows_best_checkpoint_and_tensorboard(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 6, "--holdout", 1,
                                 "--val-every", 2, "--lr", "1e-2", "--out", out], capsys)
    assert code == 0, err
    rows = read_jsonl(out / "metrics.jsonl")
    validated = [r for r in rows if "val_dice" in r]
    assert [r["step"] for r in validated] == [2, 4, 6]
    for row in validated:
        assert set(row["val_dice_per_class"]) == {"1", "2"}
        defined = [d for d in row["val_dice_per_class"].values() if d == d]
        assert row["val_dice"] == pytest.approx(sum(defined) / len(defined))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_dice"] == validated[-1]["val_dice"]
    best = max(validated, key=lambda r: r["val_dice"])
    assert (summary["best_val_dice"], summary["best_step"]) == (best["val_dice"], best["step"])
    state = json.loads((out / "checkpoints" / "best" / "state.json").read_text())
    assert (state["step"], state["val_dice"]) == (best["step"], best["val_dice"])
    assert "validation at step 6: Dice " in stdout

    train = _scalars(out / "tensorboard" / "train")
    assert [step for step, _ in train["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in train["loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    validation = _scalars(out / "tensorboard" / "validation")
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in validation["dice"]] == [
        (r["step"], r["val_dice"]) for r in validated]
    assert set(validation) == {"dice", "dice/class_1", "dice/class_2"}


def test_a_resumed_run_remembers_its_best(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    common = ["train", "--model", "tiny", "--data", tiny_store, "--holdout", 1, "--val-every", 2, "--out", out]
    assert run_cli([*common, "--steps", 2], capsys)[0] == 0
    first = json.loads((out / "checkpoints" / "best" / "state.json").read_text())
    code, _, err = run_cli(["train", "--out", out, "--resume", "--steps", 4], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_val_dice"] >= first["val_dice"]
    assert json.loads((out / "checkpoints" / "best" / "state.json").read_text())["val_dice"] == summary["best_val_dice"]


def test_validation_needs_held_out_cases(tmp_path, tiny_store, capsys):
    code, _, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 2, "--val-every", 1,
                            "--out", tmp_path / "run"], capsys)
    assert code == 2
    assert err.strip() == ("bigmem train: error: --val-every needs held-out cases to validate on: give --holdout N "
                           "(the last N cases are kept out of training) or --fold K.")


@pytest.mark.slow
def test_a_run_on_patches_is_validated_in_windows_of_its_patch(tmp_path, tiny_store, capsys):
    """A data-parallel run on 8^3 patches: val_dice is predict's sliding windows of 8^3 (its default) + evaluate."""
    import subprocess
    import sys

    from bigmem.infer.evaluate import evaluate

    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(tiny_store),
                             "--steps", "4", "--holdout", "1", "--val-every", "2", "--strategy", "mirrored",
                             "--simulate-replicas", "2", "--patch", "8", "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "plan.json").read_text())["data_parallel"]["patch"] == [8, 8, 8]
    code, stdout, err = run_cli(["predict", out, tiny_store, "--cases", "synth_0003", "-o", tmp_path / "pred",
                                 "--mode", "sliding"], capsys)
    assert code == 0, err
    val = json.loads((out / "summary.json").read_text())
    summary = evaluate(tmp_path / "pred", tiny_store, allow_missing=True)
    assert summary["foreground_mean_defined"]["Dice"] == pytest.approx(val["val_dice"], abs=1e-12)
    from bigmem.infer.predict import load_predictor

    assert load_predictor(out).window == (8, 8, 8)  # predict's default window: the patch, from plan.json
