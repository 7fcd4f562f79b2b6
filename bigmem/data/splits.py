"""nnU-Net v2's cross-validation folds: which cases train and which validate in ``--fold K``.

nnU-Net v2 splits a dataset into 5 folds once and writes them as ``splits_final.json``: a list of
``{"train": [case ids], "val": [case ids]}``, one per fold. It reads an existing file as it is
(a user's own splits, any number of folds), and makes one only when none exists. ``--fold all``
trains on every case and validates on every case. bigmem does the same, with the same rule, so
fold K of a dataset holds the same cases in both.

The rule, as nnU-Net v2 writes it (checked against its source):

- ``nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py``, ``nnUNetTrainer.do_split``: the case
  identifiers sorted (``np.sort``), then ``generate_crossval_split(ids, seed=12345, n_splits=5)``;
  fold ``all`` trains and validates on every identifier.
- ``nnunetv2/utilities/crossval_split.py``, ``generate_crossval_split``: scikit-learn's
  ``KFold(n_splits, shuffle=True, random_state=seed)``; each fold's train and val keys are the ids
  at the indices ``KFold.split`` yields.
- scikit-learn's ``KFold._iter_test_indices`` shuffles ``arange(n)`` in place with
  ``np.random.RandomState(seed)`` and cuts it into ``n_splits`` consecutive runs, the first
  ``n % n_splits`` one longer; ``BaseCrossValidator.split`` turns each run into a mask, so both
  index lists come out ascending: train and val keys are in sorted order.

``crossval_splits`` reproduces that with numpy alone (scikit-learn is not a dependency of
bigmem): ``RandomState.shuffle`` is numpy's legacy generator, whose stream numpy keeps fixed.
tests/data/test_splits.py compares it with scikit-learn where that is installed, and with folds
scikit-learn produced once, hard-coded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bigmem.errors import ConfigError, DataError

SPLITS_FILE = "splits_final.json"  # nnU-Net v2's name, in its preprocessed dataset folder
NUM_FOLDS = 5  # nnU-Net v2's default (nnUNetTrainer.do_split)
SPLIT_SEED = 12345  # nnU-Net v2's seed (nnUNetTrainer.do_split)
ALL = "all"  # --fold all: every case trains, and every case validates


def crossval_splits(case_ids: Sequence[str], num_folds: int = NUM_FOLDS,
                    seed: int = SPLIT_SEED) -> list[dict[str, list[str]]]:
    """nnU-Net v2's cross-validation folds of ``case_ids`` (``splits_final.json``'s content).

    Args:
        case_ids: the dataset's case identifiers, in any order (they are sorted first, as nnU-Net does).
        num_folds: folds (default 5).
        seed: the shuffle's seed (default 12345, nnU-Net's).

    Returns:
        ``num_folds`` dicts ``{"train": [...], "val": [...]}``, each list in sorted order; every case
        is in exactly one ``val``.

    Raises:
        DataError: fewer cases than folds (scikit-learn's KFold refuses them too).

    Example:
        >>> [s["val"] for s in crossval_splits([f"case_{i:03d}" for i in range(10)])][:2]
        [['case_000', 'case_007'], ['case_003', 'case_009']]
    """
    ids = sorted(str(c) for c in case_ids)
    if len(ids) < num_folds:
        raise DataError(f"Cannot split {len(ids)} case{'s' * (len(ids) != 1)} into {num_folds} folds: nnU-Net's "
                        f"cross-validation needs at least {num_folds} cases. Give a {SPLITS_FILE} of your own "
                        "({data.splits} FILE) or more cases.")
    order = np.arange(len(ids))
    np.random.RandomState(seed).shuffle(order)
    sizes = [len(ids) // num_folds + (1 if k < len(ids) % num_folds else 0) for k in range(num_folds)]
    splits, start = [], 0
    for size in sizes:
        val = np.zeros(len(ids), dtype=bool)
        val[order[start:start + size]] = True
        start += size
        splits.append({"train": [ids[i] for i in np.flatnonzero(~val)], "val": [ids[i] for i in np.flatnonzero(val)]})
    return splits


def read_splits(path: str | os.PathLike) -> list[dict[str, list[str]]]:
    """A ``splits_final.json``: a non-empty list of ``{"train": [case ids], "val": [case ids]}``.

    Raises:
        DataError: the file cannot be read, is not JSON, or is not that list (naming the file and the entry).
    """
    path = Path(path)
    try:
        splits = json.loads(path.read_text())
    except OSError as exc:
        raise DataError(f"Cannot read splits file {str(path)!r}: {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise DataError(f"Splits file {str(path)!r} is not JSON ({exc}); expected nnU-Net's splits_final.json: a "
                        'list of {"train": [case ids], "val": [case ids]}.') from None
    if not isinstance(splits, list) or not splits:
        raise DataError(f"Splits file {str(path)!r}: expected a non-empty list of folds "
                        '{"train": [case ids], "val": [case ids]} (nnU-Net\'s splits_final.json).')
    for fold, entry in enumerate(splits):
        if not isinstance(entry, dict) or any(
                not isinstance(entry.get(key), list) or not all(isinstance(c, str) for c in entry[key])
                for key in ("train", "val")):
            raise DataError(f"Splits file {str(path)!r}: fold {fold} is not {{\"train\": [case ids], \"val\": "
                            "[case ids]}} with case ids as strings.")
    return splits


@dataclass(frozen=True)
class FoldSplit:
    """The cases of one fold: ``train`` and ``val`` ids, the folds they came from, and where those came from.

    ``source`` is the splits file read, or '' where the folds were made (``crossval_splits``); ``splits``
    is None for fold ``all``, which needs none.
    """

    fold: str
    train: tuple[str, ...]
    val: tuple[str, ...]
    splits: list[dict[str, list[str]]] | None
    source: str


def fold_split(case_ids: Sequence[str], fold: str, *, store_path: str | os.PathLike,
               splits_file: str | os.PathLike | None = None) -> FoldSplit:
    """Fold ``fold`` of a store's cases, as nnU-Net v2's ``do_split`` chooses it.

    The folds are ``splits_file`` where given, else a ``splits_final.json`` beside the store (as nnU-Net
    reads one from its preprocessed dataset folder), else nnU-Net's 5 folds of ``case_ids``
    (``crossval_splits``). A file is used as it is, however many folds it has.

    Args:
        case_ids: the store's cases.
        fold: "0", "1", ... or "all" (``data.fold``).
        store_path: the store (its folder is searched for ``splits_final.json``).
        splits_file: nnU-Net's ``splits_final.json`` to use (``data.splits``; default None).

    Returns:
        The fold's ``FoldSplit``.

    Raises:
        ConfigError: (``data.fold``) a fold the splits do not have.
        DataError: a splits file that cannot be read, or names a case the store does not hold; too few
            cases to make 5 folds.

    Example:
        >>> fold_split([f"case_{i:03d}" for i in range(10)], "1", store_path="d.h5").val
        ('case_003', 'case_009')
    """
    if fold == ALL:
        ids = tuple(sorted(case_ids))
        return FoldSplit(fold, ids, ids, None, "")
    beside = Path(store_path).parent / SPLITS_FILE
    path = Path(splits_file) if splits_file is not None else beside if beside.is_file() else None
    splits = read_splits(path) if path is not None else crossval_splits(case_ids)
    index = int(fold)
    if not 0 <= index < len(splits):
        where = f"the splits in {str(path)!r}" if path is not None else "nnU-Net's 5-fold split"
        raise ConfigError("data.fold", f"Invalid {{field}} {fold}: {where} has folds 0..{len(splits) - 1}; "
                          f"expected one of them, or all.")
    known = set(case_ids)
    for key in ("train", "val"):
        missing = [c for c in splits[index][key] if c not in known]
        if missing:
            raise DataError(f"Splits file {str(path)!r}: fold {index} {key} case {missing[0]!r} is not in store "
                            f"{str(store_path)!r}; expected the store's case ids (such as {sorted(known)[0]!r}).")
    train, val = tuple(splits[index]["train"]), tuple(splits[index]["val"])
    if not train:
        raise DataError(f"Splits file {str(path)!r}: fold {index} has no training case.")
    return FoldSplit(fold, train, val, splits, str(path) if path is not None else "")

