"""Ensembles (``bigmem predict RUN_DIR RUN_DIR ...``): the mean of the members' class probabilities.

As in tests/infer/test_predict.py, the run directories are what ``bigmem train`` leaves, written by the
same writers, with networks as initialised under different seeds (training is not what is tested here).
"""

from __future__ import annotations

import dataclasses

import nibabel as nib
import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.data.preprocess import ChannelScheme, Preprocessing
from bigmem.errors import DataError, UsageError
from bigmem.infer.modelcard import ModelCard
from bigmem.infer.predict import (
    Ensemble,
    Mode,
    Predictor,
    ensemble_probabilities,
    find_inputs,
    load_ensemble,
    predict,
    predict_probabilities,
)
from bigmem.rundir import RunDir


def _make_run(path, store, seed: int, card: ModelCard | None = None):
    import keras

    from bigmem.nets.unet3d import UNet3D

    config = resolve_config("tiny", {"data": {"store": str(store)}})
    run = RunDir(path)
    run.write_config(config.to_dict())
    (card or ModelCard.from_store(store)).write(run.path)
    keras.utils.set_random_seed(seed)
    UNet3D(config.model, name="unet3d").build_for().save(run.model)
    return run.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_store):
    """Two tiny runs on tiny_store whose networks differ (seeds 0 and 1)."""
    return [_make_run(tmp_path_factory.mktemp(f"member{seed}"), tiny_store, seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def ensemble(runs):
    return load_ensemble(runs)


def _case(tiny_store, case_id="synth_0001"):
    (item,) = find_inputs(tiny_store, ModelCard.from_store(tiny_store), cases=[case_id])
    return item.load()


@pytest.mark.parametrize("mode, tta", [(Mode.WHOLE, False), (Mode.WHOLE, True), (Mode.SLIDING, False)],
                         ids=["whole", "whole-tta", "sliding"])
def test_an_ensemble_of_two_is_the_mean_of_their_probabilities(ensemble, tiny_store, mode, tta):
    image, _, stats = _case(tiny_store)
    options = dict(stats=stats, mode=mode, tta=tta, window=(8, 8, 8) if mode is Mode.SLIDING else None)
    first, second = (predict_probabilities(member, image, **options) for member in ensemble.members)
    mean = ensemble_probabilities(ensemble, image, **options)
    assert mean.dtype == np.float32
    np.testing.assert_array_equal(mean, (first + second) / 2)
    assert not np.array_equal(first, second)  # the members differ, so the mean is not either of them


def test_one_run_is_its_own_predictor(runs):
    single = load_ensemble(runs[:1])
    assert isinstance(single, Predictor)
    assert single.source == "model.keras"


def test_two_runs_make_an_ensemble_of_both(ensemble, runs):
    assert isinstance(ensemble, Ensemble)
    assert ensemble.names == tuple(str(r) for r in runs)
    assert ensemble.num_classes == 3


def test_predict_with_two_runs_writes_the_mean_and_its_argmax(runs, tiny_store, tmp_path):
    written = {}
    for name, run_dirs in (("a", runs[:1]), ("b", runs[1:]), ("ab", runs)):
        (result,) = predict(run_dirs, tiny_store, tmp_path / name, mode="whole", cases=["synth_0002"],
                            save_probabilities=True)
        written[name] = (np.load(result.probabilities_path)["probabilities"].astype(np.float32),
                         np.asarray(nib.load(result.labels_path).dataobj))
    mean = (written["a"][0] + written["b"][0]) / 2
    np.testing.assert_allclose(written["ab"][0], mean, atol=1e-3)  # each saved as float16
    np.testing.assert_array_equal(written["ab"][1], np.argmax(written["ab"][0], axis=-1))


def test_predict_with_a_list_of_one_run_equals_the_run_alone(runs, tiny_store, tmp_path):
    (alone,) = predict(runs[0], tiny_store, tmp_path / "alone", mode="whole", cases=["synth_0000"],
                       save_probabilities=True)
    (listed,) = predict([runs[0]], tiny_store, tmp_path / "listed", mode="whole", cases=["synth_0000"],
                        save_probabilities=True)
    np.testing.assert_array_equal(np.load(listed.probabilities_path)["probabilities"],
                                  np.load(alone.probabilities_path)["probabilities"])
    np.testing.assert_array_equal(np.asarray(nib.load(listed.labels_path).dataobj),
                                  np.asarray(nib.load(alone.labels_path).dataobj))


def test_a_run_of_other_classes_is_refused_naming_it(runs, tmp_path_factory):
    from bigmem.data.synth import write_synthetic_store

    store = write_synthetic_store(tmp_path_factory.mktemp("four") / "four.h5", num_cases=1, volume=16,
                                  num_classes=4, seed=0)
    other = _make_run(tmp_path_factory.mktemp("other"), store, 0)
    with pytest.raises(DataError) as raised:
        load_ensemble([runs[0], other])
    assert str(raised.value) == (
        f"Run '{other}' cannot join the ensemble: classes ['background', 'class1', 'class2', 'class3'] where "
        f"'{runs[0]}' has ['background', 'class1', 'class2']; an ensemble averages the probabilities of one set of "
        "classes over one preparation of the scan.")


def test_a_run_of_another_normalisation_is_refused_naming_it(runs, tiny_store, tmp_path_factory):
    card = ModelCard.from_store(tiny_store)
    changed = dataclasses.replace(card, preprocessing=Preprocessing((ChannelScheme("none"),)))
    other = _make_run(tmp_path_factory.mktemp("none"), tiny_store, 0, changed)
    with pytest.raises(DataError, match=rf"^Run '{other}' cannot join the ensemble: normalisation .*none.* where "
                                        rf"'{runs[1]}' has "):
        load_ensemble([runs[1], other])


def test_a_run_given_twice_is_refused(runs):
    with pytest.raises(UsageError, match=rf"^RUN_DIR '{runs[0]}' is given twice: an ensemble averages different "
                                         r"runs\.$"):
        load_ensemble([runs[0], runs[0]])


def test_the_command_takes_several_run_dirs(runs, tiny_store, tmp_path, capsys):
    from helpers import run_cli

    code, out, err = run_cli(["predict", *runs, tiny_store, "-o", tmp_path / "out", "--mode", "whole", "--cases",
                              "synth_0003"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "synth_0003.nii.gz").is_file()
    assert "Segmented 1 case into" in out


def test_the_command_names_a_run_that_disagrees_in_one_line(runs, tiny_store, tmp_path, capsys):
    from helpers import run_cli

    card = dataclasses.replace(ModelCard.from_store(tiny_store), channel_names=("T2",))
    other = _make_run(tmp_path / "t2", tiny_store, 0, card)
    code, _, err = run_cli(["predict", runs[0], other, tiny_store, "-o", tmp_path / "out"], capsys)
    assert code == 1
    assert err.strip().splitlines() == [
        f"bigmem predict: error: Run '{other}' cannot join the ensemble: channels ['T2'] where '{runs[0]}' has "
        "['synthetic']; an ensemble averages the probabilities of one set of classes over one preparation of the "
        "scan."]
