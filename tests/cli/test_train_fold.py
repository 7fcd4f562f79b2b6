"""``bigmem train --fold K``: nnU-Net v2's folds choose the training and validation cases."""

from __future__ import annotations

import json

import pytest

from bigmem.data.splits import crossval_splits
from helpers import copy_store, run_cli

SIX = [f"synth_{i:04d}" for i in range(6)]
# nnU-Net's fold 1 of these six ids (scikit-learn's KFold, seed 12345; tests/data/test_splits.py).
FOLD_1_VAL = ["synth_0004"]


@pytest.fixture(scope="module")
def six_store(tmp_path_factory):
    """Six 16^3 phantoms: enough cases for five folds."""
    from bigmem.data.synth import write_synthetic_store

    return write_synthetic_store(tmp_path_factory.mktemp("fold") / "six.h5", num_cases=6, volume=16, num_classes=3,
                                 seed=0)


def _plan(run) -> dict:
    return json.loads((run / "plan.json").read_text())


def test_fold_1_trains_on_its_train_keys_and_validates_on_its_val_keys(tmp_path, six_store, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--model", "tiny", "--data", six_store, "--fold", "1", "--steps", 1,
                                 "--val-every", 1, "--monitor-interval", 0, "--out", out], capsys)
    assert code == 0, err
    plan = _plan(out)
    assert [row["case"] for row in plan["cases"]] == [c for c in SIX if c not in FOLD_1_VAL]
    assert plan["validation"]["case"] == FOLD_1_VAL[0]
    assert json.loads((out / "splits_final.json").read_text()) == crossval_splits(SIX)
    assert json.loads((out / "config.json").read_text())["data"]["fold"] == "1"
    assert "Fold 1 of nnU-Net's 5-fold split: 5 training, 1 validation cases" in stdout
    assert "val_dice" in json.loads((out / "summary.json").read_text())


def test_a_splits_file_beside_the_store_is_honoured(tmp_path, six_store, capsys):
    store = copy_store(six_store, tmp_path / "six.h5")
    mine = [{"train": ["synth_0000", "synth_0002"], "val": ["synth_0005"]}]
    (tmp_path / "splits_final.json").write_text(json.dumps(mine))
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "tiny", "--data", store, "--fold", "0", "--steps", 1,
                            "--monitor-interval", 0, "--out", out], capsys)
    assert code == 0, err
    assert [row["case"] for row in _plan(out)["cases"]] == ["synth_0000", "synth_0002"]
    assert json.loads((out / "splits_final.json").read_text()) == mine


@pytest.mark.parametrize("flags, message", [
    (["--fold", "5"], "Invalid --fold 5: nnU-Net's 5-fold split has folds 0..4; expected one of them, or all."),
    (["--fold", "x"], "Invalid --fold 'x': expected a fold number 0..4 (nnU-Net's 5-fold cross-validation; more "
                      "with a --splits file of more folds) or all."),
    (["--fold", "1", "--holdout", "1"], "Give either --holdout or --fold, not both: a fold's val cases are the ones "
                                        "held out."),
    (["--splits", "s.json"], "--splits gives the folds of --fold: give --fold K too."),
], ids=["out-of-range", "not-a-number", "with-holdout", "splits-alone"])
def test_a_bad_fold_is_one_line_and_exit_2(tmp_path, six_store, capsys, flags, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text("[]")
    code, _, err = run_cli(["train", "--model", "tiny", "--data", six_store, "--steps", 1, *flags,
                            "--out", tmp_path / "run"], capsys)
    assert code == 2
    assert err.strip() == f"bigmem train: error: {message}"


def test_a_missing_splits_file_is_named(tmp_path, six_store, capsys):
    code, _, err = run_cli(["train", "--model", "tiny", "--data", six_store, "--fold", "0", "--splits",
                            tmp_path / "none.json", "--out", tmp_path / "run"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Cannot read splits file '{tmp_path / 'none.json'}' (--splits): no "
                           "such file; expected nnU-Net's splits_final.json.")
