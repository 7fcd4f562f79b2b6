"""``bigmem predict --val``: each fold's validation cases, so that one folder of them evaluates as nnU-Net's
cross-validation summary (every fold's validation predictions, each case once, scored together).

The run directories are what ``bigmem train --fold K`` leaves (config.json with ``data.fold``,
splits_final.json), with networks as initialised (as in tests/infer/test_predict.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.errors import UsageError
from bigmem.infer.evaluate import evaluate
from bigmem.infer.modelcard import ModelCard
from bigmem.infer.predict import predict, validation_cases
from bigmem.rundir import RunDir
from helpers import run_cli

# Two folds of tiny_store's four cases, as a splits_final.json of the user's own would give them.
SPLITS = [{"train": ["synth_0000", "synth_0001"], "val": ["synth_0002", "synth_0003"]},
          {"train": ["synth_0002", "synth_0003"], "val": ["synth_0000", "synth_0001"]}]


def _make_run(path, store, seed: int, data: dict, splits=None):
    import keras

    from bigmem.nets.unet3d import UNet3D

    config = resolve_config("tiny", {"data": {"store": str(store), **data}})
    run = RunDir(path)
    run.write_config(config.to_dict())
    if splits is not None:
        run.write_splits(splits)
    ModelCard.from_store(store).write(run.path)
    keras.utils.set_random_seed(seed)
    UNet3D(config.model, name="unet3d").build_for().save(run.model)
    return run.path


@pytest.fixture(scope="module")
def folds(tmp_path_factory, tiny_store):
    return [_make_run(tmp_path_factory.mktemp(f"fold{k}"), tiny_store, k, {"fold": str(k)}, SPLITS) for k in (0, 1)]


def test_a_folds_validation_cases_are_its_val_keys(folds):
    assert validation_cases(folds[1]) == ["synth_0000", "synth_0001"]


def test_a_holdout_runs_validation_cases_are_its_held_out_ones(tmp_path, tiny_store):
    run = _make_run(tmp_path / "holdout", tiny_store, 0, {"holdout": 1})
    assert validation_cases(run) == ["synth_0003"]


def test_a_run_that_held_out_nothing_has_no_validation_cases(tmp_path, tiny_store):
    run = _make_run(tmp_path / "all-cases", tiny_store, 0, {})
    with pytest.raises(UsageError, match=r"^predict\.validation: the run .* held out no case \(it trained with "
                                         r"neither data\.fold nor data\.holdout\); give predict\.cases instead\.$"):
        validation_cases(run)


def test_each_folds_val_into_one_folder_is_the_crossval_summary(folds, tiny_store, tmp_path):
    merged = tmp_path / "crossval"
    for run in folds:
        written = [r.case_id for r in predict(run, tiny_store, merged, mode="whole", validation=True)]
        assert written == SPLITS[int(json.loads((run / "config.json").read_text())["data"]["fold"])]["val"]
    summary = evaluate(merged, tiny_store, hausdorff=False)
    assert [c["case_id"] for c in summary["metric_per_case"]] == ["synth_0000", "synth_0001", "synth_0002",
                                                                  "synth_0003"]
    dice = [[case["metrics"][k]["Dice"] for case in summary["metric_per_case"]] for k in ("1", "2")]
    assert summary["mean"]["1"]["Dice"] == pytest.approx(np.nanmean(dice[0]))
    assert summary["mean"]["2"]["Dice"] == pytest.approx(np.nanmean(dice[1]))


def test_val_with_cases_or_several_runs_is_refused(folds, tiny_store, tmp_path, capsys):
    code, _, err = run_cli(["predict", folds[0], tiny_store, "--val", "--cases", "synth_0002", "-o", tmp_path],
                           capsys)
    assert code == 2
    assert err.strip() == ("bigmem predict: error: --val segments one run's validation cases: give one RUN_DIR and no "
                           "--cases.")
