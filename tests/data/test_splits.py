"""nnU-Net v2's cross-validation folds (data/splits.py), against scikit-learn's KFold as nnU-Net calls it.

The hard-coded folds were produced once with scikit-learn 1.9.1, as nnU-Net v2 makes them
(nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py do_split -> nnunetv2/utilities/crossval_split.py
generate_crossval_split):

    ids = list(np.sort(ids))
    for train, val in KFold(n_splits=5, shuffle=True, random_state=12345).split(ids):
        print([ids[i] for i in val])
"""

from __future__ import annotations

import json

import pytest

from bigmem.data.splits import crossval_splits, fold_split, read_splits
from bigmem.errors import ConfigError, DataError

TEN = [f"case_{i:03d}" for i in range(10)]
TEN_VAL = [["case_000", "case_007"], ["case_003", "case_009"], ["case_004", "case_006"], ["case_001", "case_008"],
           ["case_002", "case_005"]]
SIX = [f"synth_{i:04d}" for i in range(6)]  # bigmem synth's ids
SIX_VAL = [["synth_0003", "synth_0005"], ["synth_0004"], ["synth_0000"], ["synth_0001"], ["synth_0002"]]
# Given unsorted, with capitals (which sort first, as np.sort sorts them) and odd lengths.
MIXED = ["liver_10", "liver_2", "Liver_3", "liver_1", "kidney_7", "la_003", "la_01", "x", "B", "a", "liver_0", "z_9",
         "hippo"]
MIXED_VAL = [["B", "liver_0", "liver_10"], ["hippo", "la_01", "liver_2"], ["liver_1", "x", "z_9"],
             ["Liver_3", "kidney_7"], ["a", "la_003"]]


@pytest.mark.parametrize("ids, expected", [(TEN, TEN_VAL), (SIX, SIX_VAL), (MIXED, MIXED_VAL)],
                         ids=["ten", "six", "mixed"])
def test_the_val_keys_are_nnunets(ids, expected):
    assert [s["val"] for s in crossval_splits(ids)] == expected


@pytest.mark.parametrize("ids", [TEN, SIX, MIXED], ids=["ten", "six", "mixed"])
def test_the_train_keys_are_the_rest_in_sorted_order(ids):
    for split in crossval_splits(ids):
        assert split["train"] == sorted(set(ids) - set(split["val"]))


def test_the_order_given_does_not_matter():
    assert crossval_splits(list(reversed(TEN))) == crossval_splits(TEN)


@pytest.mark.parametrize("num_cases", [5, 6, 7, 11, 23, 40, 101])
def test_equals_scikit_learn_where_installed(num_cases):
    np = pytest.importorskip("numpy")
    model_selection = pytest.importorskip("sklearn.model_selection")
    ids = [f"c{(i * 7919) % 1000:03d}" for i in range(num_cases)]
    ordered = list(np.sort(ids))
    expected = [{"train": [ordered[i] for i in train], "val": [ordered[i] for i in val]}
                for train, val in model_selection.KFold(n_splits=5, shuffle=True, random_state=12345).split(ordered)]
    assert crossval_splits(ids) == expected


def test_fewer_cases_than_folds_is_refused():
    with pytest.raises(DataError, match=r"^Cannot split 4 cases into 5 folds: nnU-Net's cross-validation needs at "
                                        r"least 5 cases\. Give a splits_final\.json of your own \(data\.splits FILE\)"):
        crossval_splits(TEN[:4])


def test_a_fold_is_made_when_no_file_exists(tmp_path):
    split = fold_split(TEN, "1", store_path=tmp_path / "d.h5")
    assert (split.train, split.val) == (tuple(crossval_splits(TEN)[1]["train"]), ("case_003", "case_009"))
    assert split.source == ""


def test_fold_all_trains_and_validates_on_every_case(tmp_path):
    split = fold_split(list(reversed(SIX)), "all", store_path=tmp_path / "d.h5")
    assert split.train == tuple(SIX)
    assert split.val == tuple(SIX)
    assert split.splits is None


def test_a_file_beside_the_store_is_used_as_it_is(tmp_path):
    mine = [{"train": ["case_001"], "val": ["case_000"]}, {"train": ["case_000"], "val": ["case_001"]}]
    (tmp_path / "splits_final.json").write_text(json.dumps(mine))
    split = fold_split(TEN, "1", store_path=tmp_path / "d.h5")
    assert (split.train, split.val) == (("case_000",), ("case_001",))
    assert split.source == str(tmp_path / "splits_final.json")


def test_a_given_file_wins_over_one_beside_the_store(tmp_path):
    (tmp_path / "splits_final.json").write_text(json.dumps([{"train": ["case_001"], "val": ["case_000"]}]))
    given = tmp_path / "mine.json"
    given.write_text(json.dumps([{"train": ["case_002"], "val": ["case_003"]}]))
    assert fold_split(TEN, "0", store_path=tmp_path / "d.h5", splits_file=given).val == ("case_003",)


def test_a_fold_the_splits_lack_is_refused_naming_the_folds(tmp_path):
    with pytest.raises(ConfigError) as raised:
        fold_split(TEN, "5", store_path=tmp_path / "d.h5")
    assert raised.value.render(lambda f: "--fold") == ("Invalid --fold 5: nnU-Net's 5-fold split has folds 0..4; "
                                                       "expected one of them, or all.")


def test_a_case_the_store_lacks_is_refused_naming_it(tmp_path):
    given = tmp_path / "mine.json"
    given.write_text(json.dumps([{"train": ["case_001", "nope"], "val": ["case_000"]}]))
    with pytest.raises(DataError, match=rf"^Splits file '{given}': fold 0 train case 'nope' is not in store "):
        fold_split(TEN, "0", store_path=tmp_path / "d.h5", splits_file=given)


@pytest.mark.parametrize("text, message", [
    ("{", r"is not JSON"),
    ("[]", r"expected a non-empty list of folds"),
    ('[{"train": ["a"]}]', r"fold 0 is not \{\"train\": \[case ids\], \"val\": \[case ids\]\}"),
    ('[{"train": ["a"], "val": [1]}]', r"fold 0 is not \{\"train\""),
], ids=["not-json", "empty", "no-val", "not-strings"])
def test_a_malformed_splits_file_is_refused(tmp_path, text, message):
    path = tmp_path / "splits_final.json"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^Splits file '{path}'(: | ){message}"):
        read_splits(path)
