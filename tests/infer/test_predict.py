"""bigmem.infer.predict's API: run directories, inputs, one case's probabilities and labels, the files written.

The command (``bigmem predict`` on a trained run, flags, printing) is tests/cli/test_predict_command.py's.
Training even one step takes over 10 s on 2 cores, and these tests ask nothing of the weights, so
the run directory here is what ``bigmem train`` leaves, written by the same writers, with the
network as initialised (a fixed seed).
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.errors import DataError, UsageError
from bigmem.infer.modelcard import ModelCard
from bigmem.infer.predict import (
    KeptOutput,
    Mode,
    Predictor,
    find_inputs,
    labels_path_of,
    load_predictor,
    predict,
    predict_case,
    predict_probabilities,
    run_config,
    write_nifti,
    write_probabilities,
)
from bigmem.rundir import RunDir

CASES = ["synth_0000", "synth_0001", "synth_0002", "synth_0003"]  # tiny_store's


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_store):
    """A finished tiny run on tiny_store: config.json, preprocessing.json, model.keras, as the trainer writes them."""
    import keras

    from bigmem.nets.unet3d import UNet3D

    config = resolve_config("tiny", {"data": {"store": str(tiny_store)}})
    run = RunDir(tmp_path_factory.mktemp("run"))
    run.write_config(config.to_dict())
    ModelCard.from_store(tiny_store).write(run.path)
    keras.utils.set_random_seed(0)
    UNet3D(config.model, name="unet3d").build_for().save(run.model)
    return run.path


@pytest.fixture(scope="module")
def predictor(run_dir):
    return load_predictor(run_dir)


def _store_case(tiny_store, case_id="synth_0001"):
    (item,) = find_inputs(tiny_store, ModelCard.from_store(tiny_store), cases=[case_id])
    return item


# ---- run directories ---------------------------------------------------------------------------


def test_run_config_is_the_saved_one(run_dir, tiny_store):
    config = run_config(run_dir)
    assert config.model == resolve_config("tiny", {"data": {"store": str(tiny_store)}}).model  # nnU-Net's recipe
    assert config.data.store == str(tiny_store)


def test_a_folder_without_config_json_is_not_a_run(tmp_path):
    with pytest.raises(DataError, match=rf"^'{tmp_path}' is not a bigmem run directory: no config.json there\.$"):
        run_config(tmp_path)


def test_load_predictor_reads_model_keras_and_the_runs_card(predictor, run_dir, tiny_store):
    from bigmem.nets.unet3d import UNet3D

    assert isinstance(predictor.model, UNet3D)
    assert predictor.source == "model.keras"
    assert predictor.card == ModelCard.of_run(run_dir)
    assert predictor.preparation.label_names == ("background", "class1", "class2")
    assert (predictor.num_classes, predictor.num_outputs, predictor.divisor) == (3, 3, 4)
    assert predictor.region_order is None  # softmax classes, not regions


def test_a_run_without_model_keras_has_not_finished(run_dir, tmp_path):
    unfinished = RunDir(tmp_path / "run")
    unfinished.write_config(RunDir(run_dir).read_config())
    with pytest.raises(DataError, match=rf"^No model.keras in '{unfinished.path}': the run has not finished\. Use "
                                        r"predict\.checkpoint latest \(or best\) to predict with a checkpoint\.$"):
        load_predictor(unfinished.path)


def test_the_window_is_what_the_network_trained_on():
    """The training patch, else the largest trained case, else the fixed data.shape, else the reference cube."""
    config = resolve_config("tiny")
    shaped = resolve_config("tiny", {"data": {"shape": [8, 12, 16]}})
    assert Predictor(None, config, "test", training_patch=(8, 8, 8), trained_shape=(16, 12, 8)).window == (8, 8, 8)
    assert Predictor(None, config, "test", trained_shape=(16, 12, 8)).window == (16, 12, 8)
    assert Predictor(None, shaped, "test").window == (8, 12, 16)
    assert Predictor(None, config, "test").window == (config.data.reference_volume,) * 3


# ---- inputs ------------------------------------------------------------------------------------


def test_find_inputs_of_a_store_lists_its_cases(tiny_store):
    inputs = find_inputs(tiny_store, ModelCard.from_store(tiny_store))
    assert [item.case_id for item in inputs] == CASES
    assert inputs[2].where == f"{tiny_store}:synth_0002"
    image, geometry, stats = inputs[2].load()
    assert image.shape == (16, 16, 16, 1)
    assert image.dtype == np.float32
    assert geometry.source_shape == (16, 16, 16)
    assert sorted(stats) == ["max", "mean", "min", "nonzero_box", "nonzero_mean", "nonzero_std", "std"]


def test_find_inputs_picks_cases_in_the_order_asked(tiny_store):
    inputs = find_inputs(tiny_store, ModelCard.from_store(tiny_store), cases=["synth_0003", "synth_0000"])
    assert [item.case_id for item in inputs] == ["synth_0003", "synth_0000"]


def test_an_unknown_case_is_named_with_some_that_exist(tiny_store):
    with pytest.raises(DataError, match=rf"^predict\.cases: 'synth_9' not in '{tiny_store}' \(it has 4 cases, e\.g\. "
                                        r"synth_0000, synth_0001, synth_0002\)\.$"):
        find_inputs(tiny_store, ModelCard.from_store(tiny_store), cases=["synth_0001", "synth_9"])


def test_find_inputs_of_nifti_files_and_of_one_file(tmp_path, tiny_store):
    card = ModelCard.from_store(tiny_store)
    folder = tmp_path / "scans"
    folder.mkdir()
    for name in ("b.nii.gz", "a.nii"):
        nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)), str(folder / name))
    said = []
    inputs = find_inputs(folder, card, say=said.append)
    assert [item.case_id for item in inputs] == ["a", "b"]
    assert said == [f"NIfTI files: 2 cases in {folder}"]
    assert [item.case_id for item in find_inputs(folder / "b.nii.gz", card)] == ["b"]


@pytest.mark.parametrize("name, message", [
    ("notes.txt", r"^INPUT '.*notes\.txt' is not a NIfTI file \(\.nii, \.nii\.gz\) or a bigmem store \(\.h5\)\.$"),
    ("gone.nii.gz", r"^Cannot read INPUT '.*gone\.nii\.gz': no such file or folder\.$"),
])
def test_an_unreadable_input_says_what_it_expected(tmp_path, tiny_store, name, message):
    if name == "notes.txt":
        (tmp_path / name).write_text("not a scan")
    with pytest.raises(DataError, match=message):
        find_inputs(tmp_path / name, ModelCard.from_store(tiny_store))


# ---- one case ----------------------------------------------------------------------------------


def test_probabilities_of_the_whole_case_and_of_one_window_over_it_agree(predictor, tiny_store):
    """One window as large as the case: its Gaussian weights cancel, so sliding is the whole pass."""
    image, _, stats = _store_case(tiny_store).load()
    whole = predict_probabilities(predictor, image, stats=stats, mode=Mode.WHOLE)
    sliding = predict_probabilities(predictor, image, stats=stats, mode=Mode.SLIDING, window=(16, 16, 16))
    assert whole.shape == (16, 16, 16, 3)
    assert whole.dtype == np.float32
    np.testing.assert_allclose(whole.sum(axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(sliding, whole, atol=1e-5)


def test_a_case_off_the_size_contract_is_padded_and_cropped_back(predictor, tiny_store):
    """9 x 10 x 11 voxels: padded to multiples of 4 for the network, the probabilities cropped to the case."""
    image, _, stats = _store_case(tiny_store).load()
    odd = np.ascontiguousarray(image[:9, :10, :11])
    probabilities = predict_probabilities(predictor, odd, stats=stats, mode=Mode.WHOLE)
    assert probabilities.shape == (9, 10, 11, 3)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, atol=1e-5)


def test_predict_case_writes_the_argmax_in_the_source_geometry(predictor, tiny_store, tmp_path):
    """The phantoms' source grid is the store's (identity affine): the labels are the probabilities' argmax."""
    item = _store_case(tiny_store)
    image, _, stats = item.load()
    probabilities = predict_probabilities(predictor, image, stats=stats, mode=Mode.WHOLE)
    result = predict_case(predictor, item, tmp_path, mode=Mode.WHOLE, save_probabilities=True)
    assert (result.case_id, result.mode, result.shape) == ("synth_0001", "whole", (16, 16, 16))
    assert result.labels_path == labels_path_of(tmp_path, "synth_0001")
    labels = nib.load(str(result.labels_path))
    assert labels.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asanyarray(labels.dataobj), np.argmax(probabilities, axis=-1))
    np.testing.assert_array_equal(labels.affine, np.eye(4))
    saved = np.load(result.probabilities_path)
    np.testing.assert_allclose(saved["probabilities"].astype(np.float32), probabilities, atol=1e-3)  # float16
    assert result.peak_rss_bytes > 0


def test_predict_case_asks_a_mode_chooser_with_the_cases_shape(predictor, tiny_store, tmp_path):
    asked = []

    def choose(chooser_predictor, shape):
        asked.append((chooser_predictor, shape))
        return Mode.SLIDING

    result = predict_case(predictor, _store_case(tiny_store), tmp_path, mode=choose, window=(16, 16, 16))
    assert asked == [(predictor, (16, 16, 16))]
    assert result.mode == "sliding"


# ---- files -------------------------------------------------------------------------------------


def test_write_nifti_round_trips_labels_and_affine(tmp_path):
    labels = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    affine = np.array([[0.0, 0.0, -2.0, 90.0], [-1.5, 0.0, 0.0, 120.0], [0.0, 1.2, 0.0, -60.0], [0, 0, 0, 1]])
    path = write_nifti(labels, affine, tmp_path / "c.nii.gz")
    image = nib.load(str(path))
    np.testing.assert_array_equal(np.asanyarray(image.dataobj), labels)
    np.testing.assert_allclose(image.affine, affine, atol=1e-6)
    assert (int(image.header["sform_code"]), int(image.header["qform_code"])) == (1, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["c.nii.gz"]  # no temporary left beside it


def test_write_probabilities_keeps_float16_and_the_affine(tmp_path):
    probabilities = np.full((2, 3, 4, 2), 0.5, np.float16)
    path = write_probabilities(probabilities, np.eye(4) * 2, tmp_path / "c_probabilities.npz")
    saved = np.load(path)
    assert sorted(saved.files) == ["affine", "probabilities"]
    assert saved["probabilities"].dtype == np.float16
    np.testing.assert_array_equal(saved["probabilities"], probabilities)
    np.testing.assert_array_equal(saved["affine"], np.eye(4) * 2)


# ---- predict -----------------------------------------------------------------------------------


def test_predict_keeps_what_is_there_and_segments_what_is_missing(run_dir, tiny_store, tmp_path):
    def run(**kwargs):
        return list(predict(run_dir, tiny_store, tmp_path, cases=["synth_0002"], mode="whole", **kwargs))

    (first,) = run()
    assert first.labels_path == tmp_path / "synth_0002.nii.gz"
    assert run() == [KeptOutput("synth_0002", tmp_path / "synth_0002.nii.gz")]
    (with_probabilities,) = run(save_probabilities=True)  # asked for more than is there: segmented again
    assert with_probabilities.probabilities_path == tmp_path / "synth_0002_probabilities.npz"


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="hole"), r"^Invalid predict\.mode 'hole': expected one of auto, whole, sliding\. Did you mean "
                        r"'whole'\?$"),
    (dict(mode="auto"), r"^predict\.mode auto needs a way to choose \(the inference plan\); give predict\.mode "
                        r"whole or sliding\.$"),
    (dict(mode="whole", overlap=1.0), r"^Invalid predict\.overlap 1: expected a fraction in \[0, 1\)\.$"),
    (dict(mode="sliding", window=(8, 0, 8)), r"^Invalid predict\.window 8,0,8: expected a positive integer N or "
                                             r"D,H,W\.$"),
    (dict(mode="sliding", window=6), r"^Invalid predict\.window 6: expected a positive multiple of 4 \(the network "
                                     r"downsamples 2 times\)\.$"),
], ids=["unknown-mode", "auto-without-a-chooser", "overlap-of-1", "empty-window", "window-off-the-contract"])
def test_predict_refuses_bad_options_before_writing(run_dir, tiny_store, tmp_path, kwargs, message):
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=message):
        next(predict(run_dir, tiny_store, out, **kwargs))
    assert not out.exists()
