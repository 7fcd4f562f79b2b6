"""The HDF5 store format (docs/store.md) and ``HDF5VolumeStore``, its reader.

Layout: ``/cases/<case_id>/image`` (D, H, W, C) and ``/cases/<case_id>/label`` (D, H, W) uint8.
Case attributes: ``spacing``, ``affine``, ``source_affine``, ``source_image``, ``source_label``,
``intensity_stats`` (JSON: ``bigmem.data.preprocess.case_statistics``), ``label_max`` and
``nonfinite_voxels`` (the largest label value and the count of NaN/Inf image voxels, as written:
what ``HDF5VolumeStore.validate_for_training`` checks without reading the voxels);
``/cases/<case_id>/foreground`` (N, C) float32 holds a sample of the case's foreground voxels
where the CT statistics need it.
Root attributes: ``bigmem_store_version``, ``num_classes``, ``channel_names``, ``label_names``,
``preprocessing`` (JSON: ``bigmem.data.preprocess.Preprocessing``; absent: per-case z-score), and
``regions`` where the classes stand for nnU-Net regions (JSON ``{"whole_tumor": [1, 2, 3], ...}``).
Images are stored as int16, float16 or float32 (``preprocess.storage_dtype``) and read as float32.

h5py serialises every call behind one global lock and a file handle must never cross a fork:
a store is opened in the process that reads it, and reopened if the process id changes.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

from bigmem.data import DEFAULT_CHUNK_EDGE
from bigmem.data.preprocess import PREPROCESSING_ATTR, STATS_ATTR, Preprocessing, case_statistics, complete
from bigmem.data.splits import FoldSplit, fold_split
from bigmem.errors import DataError
from bigmem.atomic import atomic_hdf5
from bigmem.units import format_bytes

STORE_VERSION = 1
# Root attribute: JSON {region name: [label values]}: nnU-Net v2 regions, trained as the classes whose label
# values they unite and scored as regions (written by convert for region labels; absent: plain classes).
REGIONS_ATTR = "regions"
REGIONS_EXAMPLE = '{"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}'
# Case attributes StoreWriter records as it writes a case (it holds every voxel then), so that training can
# refuse bad values before its first step without reading the store; stores written before them are scanned.
LABEL_MAX_ATTR = "label_max"
NONFINITE_ATTR = "nonfinite_voxels"


def nonfinite_voxels(image: np.ndarray) -> int:
    """How many values of ``image`` are NaN or Inf (0 for an integer image).

    One summing pass without a full-size temporary: the sum (float32 at least) is finite unless a
    value is NaN/Inf, or finite values overflow it, which the exact count then clears. As fast as
    ``isfinite`` without its temporary (timings: benchmarks/results/input_pipeline.md).
    """
    if not np.issubdtype(image.dtype, np.floating):
        return 0
    if np.isfinite(np.sum(image, dtype=np.result_type(image.dtype, np.float32))):
        return 0
    return int(np.count_nonzero(~np.isfinite(image)))


def checked_regions(raw, where: str, num_classes: int | None = None) -> dict[str, list[int]]:
    """Regions as a store (or a dataset.json) holds them, checked: name -> sorted foreground label values.

    Args:
        raw: ``{name: [values]}`` (a single value may stand for its one-element list, as nnU-Net v2
            writes ``"enhancing_tumor": 3``), a JSON string of it (a store's ``regions`` attribute),
            or None.
        where: what held them, for messages (``"Store 'brats.h5'"``).
        num_classes: labels are ``0..num_classes - 1``; None: up to 255.

    Returns:
        ``{name: sorted values}`` in the order given; ``{}`` for None or an empty mapping.

    Raises:
        DataError: not a mapping of names to label values, an empty region, or a value outside
            ``1..num_classes - 1`` (background belongs to no region).

    Example:
        >>> checked_regions('{"whole_tumor": [3, 1, 2], "enhancing_tumor": 3}', "Store 'brats.h5'", 4)
        {'whole_tumor': [1, 2, 3], 'enhancing_tumor': [3]}
    """
    if raw is None:
        return {}
    if isinstance(raw, (bytes, str)):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise DataError(f"{where}: regions are not valid JSON ({exc}); expected {REGIONS_EXAMPLE}.") from None
    if not isinstance(raw, dict):
        raise DataError(f"{where}: regions must map region names to label values, such as {REGIONS_EXAMPLE}.")
    limit = num_classes - 1 if num_classes is not None else 255
    regions = {}
    for name, values in raw.items():
        values = [values] if isinstance(values, int) and not isinstance(values, bool) else values
        if not (isinstance(values, list) and values and
                all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
            raise DataError(f"{where}: region {name!r} is {json.dumps(values)}; expected a list of label values, "
                            f"such as {REGIONS_EXAMPLE}.")
        wrong = [v for v in values if not 1 <= v <= limit]
        if wrong:
            raise DataError(f"{where}: region {name!r} has label values {wrong}; expected labels 1..{limit} "
                            "(background belongs to no region).")
        regions[str(name)] = sorted(set(values))
    return regions


@dataclass(frozen=True)
class CaseInfo:
    """One case of a store as its layout describes it: id, ``(D, H, W)``, channels, image dtype."""

    case_id: str
    shape: tuple[int, int, int]
    num_channels: int
    image_dtype: str


class HDF5VolumeStore:
    """Read-only access to a bigmem store; checks the layout when opened, the values when read.

    Opening reads the root attributes and every case's shapes (not its voxels). Images read as
    ``(D, H, W, C)`` float32, labels as ``(D, H, W)`` uint8. A handle is opened per process and
    reopened after a fork, so a store may be passed to reader processes.

    Args:
        path: the store's file.
        cold_cache: drop the store's pages from the page cache after every read
            (posix_fadvise DONTNEED), to behave as a dataset larger than RAM would (default False).
        direct_read: read contiguous, uncompressed datasets with one pread at their file offset
            straight into the array, with no HDF5 layer or intermediate copy (default True).
        check_finite: check every read image for NaN/Inf here (default True; one summing pass, no
            temporary). The input pipeline keeps it on: it normalises with the statistics convert
            recorded, so nothing else would see a damaged voxel.
        holdout: keep the last N cases (sorted ids) out of ``cases``, in ``held_out`` (default 0).
        fold: nnU-Net v2's cross-validation fold ("0".."4" or "all"; ``splits.fold_split``): ``cases`` are
            its train cases, ``held_out`` its val cases, ``split`` the whole ``FoldSplit`` (default None).
        splits: the ``splits_final.json`` ``fold`` is taken from (default None: one beside the store, else
            nnU-Net's 5 folds of the store's cases).

    Raises:
        DataError: the file is missing, not HDF5, not a bigmem store, of a newer store version,
            has no cases or a case with a missing dataset or inconsistent shapes or channels; or
            ``holdout`` would leave no case; or the splits cannot be read or name a case it lacks.
        ConfigError: (``data.fold``) a fold the splits do not have.

    Example:
        >>> with HDF5VolumeStore("synth.h5") as store:
        ...     image, label = store.read_case(store.case_ids[0])  # (D, H, W, C) float32, (D, H, W) uint8
    """

    def __init__(self, path: str | os.PathLike, *, cold_cache: bool = False, direct_read: bool = True,
                 check_finite: bool = True, holdout: int = 0, fold: str | None = None,
                 splits: str | os.PathLike | None = None):
        self.path = Path(path)
        self.check_finite = check_finite
        self.cold_cache = cold_cache
        self.direct_read = direct_read
        self._file: h5py.File | None = None
        self._fd: int | None = None
        self._layout: dict[str, tuple | None] = {}  # case -> contiguous (offset, shape, dtype) x 2, or None
        self._pid = -1
        handle = self._handle()
        self.num_classes = self._num_classes(handle)
        self.channel_names = [str(n) for n in handle.attrs.get("channel_names", [])]
        self.label_names = [str(n) for n in handle.attrs.get("label_names", [])]
        self._regions = self._read_regions(handle)
        self.cases = self._check_layout(handle)
        self.preprocessing = Preprocessing.from_json(handle.attrs.get(PREPROCESSING_ATTR), self.cases[0].num_channels,
                                                     f"Store {str(self.path)!r}")
        self.preprocessing_recorded = PREPROCESSING_ATTR in handle.attrs  # False: the default, for an older store
        self._stats: dict[str, dict] = {}
        self.split: FoldSplit | None = None
        if fold is not None:  # nnU-Net's fold: its train cases train, its val cases are held out
            self.split = fold_split([c.case_id for c in self.cases], str(fold), store_path=self.path,
                                    splits_file=splits)
            by_id = {c.case_id: c for c in self.cases}
            self.held_out_cases = [by_id[c] for c in self.split.val]
            self.held_out = list(self.split.val)
            self.cases = [by_id[c] for c in self.split.train]
        elif holdout:  # the last ``holdout`` cases are kept for evaluation
            if holdout >= len(self.cases):
                raise DataError(f"Cannot hold out {holdout} of the {len(self.cases)} cases in {str(self.path)!r}: "
                                "training needs at least one.")
            self.held_out_cases = self.cases[-holdout:]
            self.held_out = [c.case_id for c in self.held_out_cases]
            self.cases = self.cases[:-holdout]
        else:
            self.held_out_cases: list[CaseInfo] = []
            self.held_out = []

    # ---- opening -------------------------------------------------------------------------

    def _handle(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file = self._open()
            self._fd = None
            self._pid = os.getpid()
        return self._file

    def _raw_fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    @staticmethod
    def _contiguous(dataset: h5py.Dataset) -> tuple | None:
        """(file offset, shape, dtype) of a contiguous, uncompressed, native-endian dataset, else None."""
        if dataset.chunks is not None or dataset.compression is not None or not dataset.dtype.isnative:
            return None
        offset = dataset.id.get_offset()
        return None if offset is None else (offset, dataset.shape, dataset.dtype)

    def _read(self, dataset: h5py.Dataset) -> np.ndarray:
        """The whole dataset; one pread at its offset when it is contiguous and uncompressed."""
        layout = self._contiguous(dataset) if self.direct_read else None
        return dataset[...] if layout is None else self._pread(*layout)

    def _pread(self, offset: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        view = memoryview(out).cast("B")
        done = 0
        while done < out.nbytes:  # pread may return fewer bytes than asked
            n = os.preadv(self._raw_fd(), [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read at byte {offset + done} (file truncated?)")
            done += n
        return out

    def _drop_cache(self) -> None:
        if self.cold_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._raw_fd(), 0, 0, os.POSIX_FADV_DONTNEED)

    def _num_classes(self, handle: h5py.File) -> int:
        value = handle.attrs["num_classes"]
        try:
            num_classes = int(value)
        except (TypeError, ValueError):
            num_classes = None
        if num_classes is None or not 2 <= num_classes <= 256:
            shown = value.item() if isinstance(value, np.generic) else value
            raise DataError(f"Cannot open store {str(self.path)!r}: its num_classes (root attribute) is {shown!r}; "
                            "expected 2..256 (background + at least one class). The store is damaged or was not "
                            "written by bigmem: write it again with 'bigmem convert' or 'bigmem synth'.")
        return num_classes

    def _read_regions(self, handle: h5py.File) -> dict[str, list[int]]:
        return checked_regions(handle.attrs.get(REGIONS_ATTR), f"Store {str(self.path)!r}", self.num_classes)

    def _open(self) -> h5py.File:
        if not self.path.exists():
            raise DataError(f"Cannot open store {str(self.path)!r}: no such file. Create one with "
                            "'bigmem synth' or 'bigmem convert'.")
        if self.path.is_dir():
            raise DataError(f"Cannot open store {str(self.path)!r}: it is a directory; expected a store file "
                            "(.h5) written by 'bigmem synth' or 'bigmem convert'.")
        try:
            handle = h5py.File(self.path, "r")
        except OSError as exc:  # HDF5's text spans lines: its first says what failed
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DataError(f"Cannot open store {str(self.path)!r}: not a readable HDF5 file ({reason}).") from None
        version = handle.attrs.get("bigmem_store_version")
        if version is None or "num_classes" not in handle.attrs:
            handle.close()
            raise DataError(f"Cannot open store {str(self.path)!r}: not a bigmem store (root attributes "
                            "'bigmem_store_version' and 'num_classes' are missing).")
        if int(version) > STORE_VERSION:
            handle.close()
            raise DataError(f"Cannot open store {str(self.path)!r}: store version {int(version)} is newer than "
                            f"this bigmem reads ({STORE_VERSION}); upgrade bigmem.")
        return handle

    def _check_layout(self, handle: h5py.File) -> list[CaseInfo]:
        where = str(self.path)
        group = handle.get("cases")
        if not isinstance(group, h5py.Group) or len(group) == 0:
            raise DataError(f"Store {where!r} has no cases (expected groups under /cases).")
        cases = []
        channels = None
        for case_id in sorted(group):
            case = group[case_id]
            for name in ("image", "label"):
                if not isinstance(case.get(name), h5py.Dataset):
                    raise DataError(f"Case {case_id!r}: missing dataset '{name}' ({where}:/cases/{case_id}).")
            image, label = case["image"], case["label"]
            if image.ndim != 4:
                raise DataError(f"Case {case_id!r}: image has shape {image.shape}; expected (D, H, W, C) "
                                f"({where}:/cases/{case_id}/image).")
            if label.shape != image.shape[:3]:
                raise DataError(f"Case {case_id!r}: label shape {tuple(label.shape)} != image shape "
                                f"{tuple(image.shape[:3])} ({where}:/cases/{case_id}).")
            if channels is None:
                channels = image.shape[3]
            elif image.shape[3] != channels:
                raise DataError(f"Case {case_id!r}: image has {image.shape[3]} channels; the store's other cases "
                                f"have {channels} ({where}).")
            cases.append(CaseInfo(case_id, tuple(int(s) for s in label.shape), int(image.shape[3]),
                                  str(image.dtype)))
        return cases

    # ---- reading -------------------------------------------------------------------------

    @property
    def case_ids(self) -> list[str]:
        """The training cases' ids, sorted (held-out cases excluded)."""
        return [c.case_id for c in self.cases]

    def root_attr(self, name: str, default=None):
        """A root attribute as stored (e.g. convert's ``convert_options`` JSON), or ``default``."""
        return self._handle().attrs.get(name, default)

    @property
    def regions(self) -> dict[str, list[int]]:
        """nnU-Net v2 regions: region name -> the label values it unites, such as ``{"whole_tumor": [1, 2, 3],
        "tumor_core": [2, 3], "enhancing_tumor": [3]}``; ``{}`` for a store of plain classes."""
        return {name: list(values) for name, values in self._regions.items()}

    @property
    def num_channels(self) -> int:
        """Image channels C (the same for every case)."""
        return self.cases[0].num_channels

    @property
    def nbytes(self) -> int:
        """Bytes of all images (float32) and labels (uint8) once read into memory."""
        return sum(int(np.prod(c.shape)) * (4 * c.num_channels + 1) for c in self.cases)

    def read_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The image and label of one case, checked.

        Args:
            case_id: a case of the store (held-out cases too).

        Returns:
            ``(image (D, H, W, C) float32, label (D, H, W) uint8)``.

        Raises:
            DataError: no such case, a read error (truncated or corrupt file), NaN/Inf image
                values (when ``check_finite``), or a label value >= ``num_classes``.
        """
        image, label = self._read_whole(case_id)
        return self._checked(case_id, np.asarray(image, dtype=np.float32), label)

    def _read_whole(self, case_id: str) -> tuple[np.ndarray, np.ndarray]:
        """A case's image and label as stored (the image in its storage dtype), unchecked."""
        handle = self._handle()
        try:
            if case_id not in self._layout:  # looked up once: h5py object access is slow per case
                case = handle["cases"][case_id]
                parts = (self._contiguous(case["image"]), self._contiguous(case["label"]))
                self._layout[case_id] = parts if self.direct_read and None not in parts else None
            layout = self._layout[case_id]
            if layout is not None:
                image, label = self._pread(*layout[0]), self._pread(*layout[1])
            else:
                case = handle["cases"][case_id]
                image, label = case["image"][...], case["label"][...]
            self._drop_cache()
        except KeyError:
            raise DataError(f"Case {case_id!r} is not in store {str(self.path)!r}.") from None
        except OSError as exc:
            raise DataError(f"Case {case_id!r}: cannot read from {str(self.path)!r} ({exc}); the store may be "
                            "truncated or corrupt.") from None
        return image, label

    def validate_for_training(self, num_classes: int | None = None, *, show_progress: bool = True) -> None:
        """Refuse, before any training step, a case whose labels reach ``num_classes`` or whose image holds NaN/Inf.

        Every case is checked, held-out ones too (validation reads them). The checks use what the
        writer recorded per case (``label_max``, ``nonfinite_voxels``); the cases of a store written
        before those records are read once, with a progress bar while it lasts (one line in a log). A store
        damaged after it was written is still refused by ``read_case`` when the case is read.

        Args:
            num_classes: the classes the network predicts (default None: the store's ``num_classes``).
            show_progress: show the progress bar of a scan (default True).

        Raises:
            DataError: naming the first bad case, its value and what was expected, e.g.
                "Case 'x': label value 5 >= number of classes 3 (store.h5); expected values 0..2: fix the
                label and convert again."

        Example:
            >>> HDF5VolumeStore("brats.h5").validate_for_training()  # returns, or raises before the first step
        """
        num_classes = self.num_classes if num_classes is None else int(num_classes)
        unrecorded = []
        for info in {c.case_id: c for c in self.cases + self.held_out_cases}.values():  # fold all: both the same
            recorded = self._recorded_values(info.case_id)
            if recorded is None:
                unrecorded.append(info)
            else:
                self._refuse_values(info.case_id, *recorded, num_classes)
        if not unrecorded:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = Console()
        what = f"Checking the labels and voxels of {len(unrecorded)} cases (the store records none)"
        if show_progress and not console.is_terminal:  # a log: one line, not a bar's redraws
            console.print(f"{what} ...")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), transient=True,
                      console=console, disable=not (show_progress and console.is_terminal)) as progress:
            task = progress.add_task(what, total=len(unrecorded))
            for info in unrecorded:
                image, label = self._read_whole(info.case_id)
                self._refuse_values(info.case_id, int(label.max()) if label.size else 0, nonfinite_voxels(image),
                                    num_classes)
                progress.advance(task)

    def _recorded_values(self, case_id: str) -> tuple[int, int] | None:
        """``(label_max, nonfinite_voxels)`` as the writer recorded them, or None (a store from before the records)."""
        attrs = self._handle()["cases"][case_id].attrs
        if LABEL_MAX_ATTR not in attrs or NONFINITE_ATTR not in attrs:
            return None
        return int(attrs[LABEL_MAX_ATTR]), int(attrs[NONFINITE_ATTR])

    def _refuse_values(self, case_id: str, label_max: int, nonfinite: int, num_classes: int) -> None:
        if nonfinite:
            raise DataError(f"Case {case_id!r}: image has {nonfinite} non-finite values (NaN/Inf) ({self.path}); "
                            "fix the source and convert again.")
        if label_max >= num_classes:
            raise DataError(f"Case {case_id!r}: label value {label_max} >= number of classes {num_classes} "
                            f"({self.path}); expected values 0..{num_classes - 1}: fix the label and convert again.")

    def case_stats(self, case_id: str) -> dict | None:
        """The case's intensity statistics as convert recorded them (``preprocess.case_statistics``), or None
        where the store recorded no complete set (written by an older bigmem)."""
        if case_id not in self._stats:
            try:
                raw = self._handle()["cases"][case_id].attrs.get(STATS_ATTR)
            except KeyError:
                raise DataError(f"Case {case_id!r} is not in store {str(self.path)!r}.") from None
            try:
                stats = json.loads(raw) if raw is not None else None
            except (TypeError, ValueError):
                raise DataError(f"Case {case_id!r}: its {STATS_ATTR} in store {str(self.path)!r} is not readable "
                                "JSON; convert the case again.") from None
            self._stats[case_id] = stats if complete(stats, self.num_channels) else None
        return self._stats[case_id]

    def remember_stats(self, case_id: str, stats: dict) -> None:
        """Keep statistics computed for a case the store recorded none for (an older store), so they are
        computed once per process, not once per patch."""
        self._stats[case_id] = stats

    def foreground_sample(self, case_id: str) -> np.ndarray | None:
        """The sample of the case's foreground voxels convert kept, ``(N, C)`` float32, or None."""
        try:
            case = self._handle()["cases"][case_id]
            return np.asarray(case["foreground"][...], np.float32) if "foreground" in case else None
        except (KeyError, OSError) as exc:
            raise DataError(f"Case {case_id!r}: cannot read its foreground sample from {str(self.path)!r} "
                            f"({exc}); the store may be damaged.") from None

    def read_label(self, case_id: str) -> np.ndarray:
        """The label map of one case, e.g. to find foreground for patch sampling.

        Args:
            case_id: a case of the store.

        Returns:
            ``(D, H, W)`` uint8 (values not checked).

        Raises:
            DataError: no such case, or a read error.
        """
        try:
            label = np.asarray(self._read(self._handle()["cases"][case_id]["label"]))
            self._drop_cache()
            return label
        except (KeyError, OSError) as exc:
            raise DataError(f"Case {case_id!r}: cannot read its label from {str(self.path)!r} ({exc}).") from None

    def read_patch(self, case_id: str, start: tuple[int, int, int], size: tuple[int, int, int]):
        """A patch starting at ``start``; only the chunks it overlaps are read.

        Args:
            case_id: a case of the store.
            start: the patch's first voxel ``(d, h, w)``.
            size: its extent ``(d, h, w)`` in voxels; cut off at the case's edge.

        Returns:
            ``(image (d, h, w, C) float32, label (d, h, w) uint8)``, checked as ``read_case``'s.

        Raises:
            DataError: as ``read_case``.
        """
        region = tuple(slice(s, s + n) for s, n in zip(start, size))
        try:
            case = self._handle()["cases"][case_id]
            image = np.asarray(case["image"][region], dtype=np.float32)
            label = np.asarray(case["label"][region])
            self._drop_cache()
        except (KeyError, OSError) as exc:
            raise DataError(f"Case {case_id!r}: cannot read a patch from {str(self.path)!r} ({exc}).") from None
        return self._checked(case_id, image, label)

    def _checked(self, case_id: str, image: np.ndarray, label: np.ndarray):
        """The values as read, checked again: ``validate_for_training`` trusts the records, and a store
        damaged after they were written would otherwise reach the network."""
        self._refuse_values(case_id, int(label.max()) if label.size else 0,
                            nonfinite_voxels(image) if self.check_finite else 0, self.num_classes)
        return image, label.astype(np.uint8, copy=False)

    def close(self) -> None:
        """Close this process's file handles (the store reopens on the next read)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
            if self._fd is not None:
                os.close(self._fd)
        self._file = None
        self._fd = None

    def __enter__(self) -> "HDF5VolumeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):  # a handle never crosses a process boundary
        state = self.__dict__.copy()
        state["_file"], state["_fd"], state["_pid"], state["_layout"] = None, None, -1, {}
        return state

    def __len__(self) -> int:
        return len(self.cases)

    def __iter__(self) -> Iterator[str]:
        return iter(self.case_ids)

    def __repr__(self) -> str:
        return (f"HDF5VolumeStore({str(self.path)!r}; cases: {len(self.cases)}; channels: {self.num_channels}; "
                f"classes: {self.num_classes}; memory: {format_bytes(self.nbytes)})")


class WriteThrottle:
    """Hands data to HDF5 in blocks of ``block_bytes`` and keeps the average rate under ``rate``.

    A storage study of MLPerf training found that ingest running beside training slowed it by up
    to ~30%, and that larger write blocks or a rate limit removed most of the loss. After each
    block the file is flushed, so the kernel sees writes of about that size at about that rate.

    Args:
        rate_bytes_per_s: the most bytes per second on average (default None: no limit).
        block_bytes: bytes per write and flush (default None: each array at once).
    """

    def __init__(self, rate_bytes_per_s: float | None = None, block_bytes: int | None = None):
        self.rate = rate_bytes_per_s
        self.block_bytes = block_bytes
        self._start = None
        self._written = 0

    @property
    def active(self) -> bool:
        """Whether a rate or block size is set (otherwise arrays are written directly)."""
        return bool(self.rate or self.block_bytes)

    def write(self, handle: h5py.File, dataset: h5py.Dataset, array: np.ndarray) -> None:
        """Write ``array`` into ``dataset`` along axis 0 in blocks (whole chunks when chunked).

        Args:
            handle: the open file, flushed after each block.
            dataset: the dataset to fill, of ``array``'s shape.
            array: the values.
        """
        import time

        plane = array[0].nbytes if array.shape[0] else 1
        planes = max(1, (self.block_bytes or array.nbytes) // plane)
        if dataset.chunks is not None:  # whole chunk rows: a partial chunk would be rewritten later
            planes = max(dataset.chunks[0], planes // dataset.chunks[0] * dataset.chunks[0])
        if self._start is None:
            self._start = time.monotonic()
        for start in range(0, array.shape[0], planes):
            block = array[start:start + planes]
            dataset[start:start + block.shape[0]] = block
            handle.flush()
            self._written += block.nbytes
            if self.rate:
                ahead = self._written / self.rate - (time.monotonic() - self._start)
                if ahead > 0:
                    time.sleep(ahead)


class StoreWriter:
    """Writes a store under a temporary name and renames it into place on ``commit``.

    Used as a context manager: an exception (or a missing commit) removes the temporary file,
    so a half-written store never stays behind. The file is written through
    ``bigmem.atomic.atomic_hdf5``: a full disk or failing device raises ``DiskFullError`` from
    the call that hit it, after the temporary file is gone (never a crash in HDF5's close).

    Args:
        path: the store to write.
        num_classes: label values are ``0..num_classes - 1``.
        channel_names: one name per image channel (their number is the channel count).
        label_names: one name per class (default ``class0``, ``class1``, ...).
        compression: an h5py filter such as ``"gzip"`` (default None: uncompressed).
        chunk_edge: chunk edge in voxels (default DEFAULT_CHUNK_EDGE, 64); None: contiguous
            datasets, which ``HDF5VolumeStore`` reads with one pread (chunks are still used when
            compressed).
        append: add cases to the existing store at ``path`` (worked on as a copy until commit).
        throttle: how writes are paced (default: unthrottled).
        expected_bytes: the store's expected size, named if the disk fills (default None: unknown;
            the message then names the bytes written before the failure).

    Raises:
        DiskFullError: (any method) the filesystem is full or failing; the writer is then closed.

    Example:
        >>> with StoreWriter("out.h5", num_classes=2, channel_names=["CT"]) as writer:
        ...     writer.add_case("case_000", np.zeros((32, 32, 32, 1), np.float32), np.zeros((32, 32, 32), np.uint8))
        ...     writer.commit()  # out.h5 now holds one case
    """

    def __init__(self, path: str | os.PathLike, *, num_classes: int, channel_names: Sequence[str],
                 label_names: Sequence[str] | None = None, compression: str | None = None,
                 chunk_edge: int | None = DEFAULT_CHUNK_EDGE, append: bool = False,
                 throttle: WriteThrottle | None = None, expected_bytes: int | None = None):
        self.path = Path(path)
        self.compression = compression
        self.chunk_edge = chunk_edge  # None: contiguous datasets (readable at their file offset)
        self.num_channels = len(channel_names)
        self.throttle = throttle or WriteThrottle()
        self.expected_bytes = expected_bytes
        # append: work on a copy, the original stays intact until the rename
        self._output = atomic_hdf5(self.path, needed_bytes=expected_bytes or 0, copy_of=self.path if append else None)
        self._file = self._output.__enter__()
        self.tmp_path = Path(self._file.filename)
        with self._writing():
            if append:
                self._cases = self._file.require_group("cases")
                return
            self._file.attrs["bigmem_store_version"] = STORE_VERSION
            self._file.attrs["num_classes"] = int(num_classes)
            self._file.attrs["channel_names"] = [str(n) for n in channel_names]
            self._file.attrs["label_names"] = [str(n) for n in (label_names or
                                                                [f"class{i}" for i in range(num_classes)])]
            self._cases = self._file.create_group("cases")

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Run a write; on a failure close and remove the temporary file, then raise (DiskFullError if the disk)."""
        if self._output is None:
            raise DataError(f"The writer of {str(self.path)!r} is closed (committed, aborted or failed).")
        try:
            yield
        except BaseException as exc:
            self._close(exc)
            raise

    def _close(self, exc: BaseException | None) -> None:
        """Leave ``atomic_hdf5``'s block: normally (commit) or with ``exc`` (abort; may raise DiskFullError)."""
        output, self._output = self._output, None
        if output is None:
            return
        if exc is None:
            output.__exit__(None, None, None)
        else:
            output.__exit__(type(exc), exc, exc.__traceback__)

    @property
    def case_ids(self) -> list[str]:
        """The cases written so far (with ``append``, the existing ones too)."""
        return list(self._cases)

    def root_attr(self, name: str):
        """The root attribute ``name`` as written so far (e.g. ``num_classes``, ``label_names``)."""
        return self._file.attrs[name]

    def set_root_attr(self, name: str, value) -> None:
        """Set the root attribute ``name`` (e.g. ``num_classes``) to ``value``."""
        with self._writing():
            self._file.attrs[name] = value

    def add_case(self, case_id: str, image: np.ndarray, label: np.ndarray, *,
                 spacing: Sequence[float] = (1.0, 1.0, 1.0), affine: np.ndarray | None = None,
                 source_affine: np.ndarray | None = None, source_image: str | Sequence[str] = "",
                 source_label: str = "", attrs: dict | None = None, foreground: np.ndarray | None = None) -> None:
        """Write one case under ``/cases/<case_id>``.

        Args:
            case_id: the case's id (unique in the store).
            image: ``(D, H, W)`` or ``(D, H, W, C)``, stored in its own dtype.
            label: ``(D, H, W)``, stored as uint8.
            spacing: voxel spacing in mm (default 1 mm on each axis).
            affine: the 4x4 voxel-to-world affine (default identity).
            source_affine: the source file's affine (default ``affine``).
            source_image, source_label: the source files' paths (``source_image``: one per channel file
                where the image came as several, nnU-Net v2's CASE_0000, CASE_0001, ...).
            attrs: more case attributes; without ``intensity_stats`` the statistics of ``image`` as given
                are recorded (convert gives those of the case before its crop or pad). ``label_max`` and
                ``nonfinite_voxels`` are always those of the arrays written.
            foreground: a sample of the case's foreground voxels ``(N, C)``, kept for the CT statistics.

        Raises:
            DataError: the shapes or channel count do not match, or ``case_id`` is already there.
            DiskFullError: the filesystem is full or failing (the temporary file is removed).
        """
        if image.ndim == 3:
            image = image[..., np.newaxis]
        if image.shape[:3] != label.shape or image.shape[3] != self.num_channels:
            raise DataError(f"Case {case_id!r}: image shape {image.shape} does not match label shape "
                            f"{label.shape} with {self.num_channels} channels.")
        if case_id in self._cases:
            raise DataError(f"Case {case_id!r} appears twice.")
        label = label.astype(np.uint8)
        attrs = dict(attrs or {})
        if STATS_ATTR not in attrs:
            try:
                attrs[STATS_ATTR] = json.dumps(case_statistics(image))
            except DataError:
                pass  # NaN/Inf values: no statistics to record, and training refuses the case
        attrs[LABEL_MAX_ATTR] = int(label.max()) if label.size else 0
        attrs[NONFINITE_ATTR] = nonfinite_voxels(image)
        with self._writing():
            group = self._cases.create_group(case_id)
            self._write_case(group, image, label)
            if foreground is not None:
                group.create_dataset("foreground", data=np.asarray(foreground, np.float32))
            for name, value in attrs.items():
                group.attrs[name] = value
            affine = np.eye(4) if affine is None else np.asarray(affine, dtype=np.float64)
            group.attrs["spacing"] = np.asarray(spacing, dtype=np.float64)
            group.attrs["affine"] = affine
            group.attrs["source_affine"] = affine if source_affine is None else np.asarray(source_affine, np.float64)
            group.attrs["source_image"] = source_image
            group.attrs["source_label"] = source_label
            self._file.flush()  # a failed metadata write surfaces here, with this case, not at commit

    def _write_case(self, group: h5py.Group, image: np.ndarray, label: np.ndarray) -> None:
        if self.chunk_edge is None and self.compression is None:
            image_chunks = label_chunks = None  # contiguous
        else:
            edge = self.chunk_edge or DEFAULT_CHUNK_EDGE  # HDF5 compresses chunked datasets only
            label_chunks = tuple(min(s, edge) for s in label.shape)
            image_chunks = label_chunks + (image.shape[3],)
        if self.throttle.active:
            for name, array, chunks in (("image", image, image_chunks), ("label", label, label_chunks)):
                dataset = group.create_dataset(name, shape=array.shape, dtype=array.dtype, chunks=chunks,
                                               compression=self.compression)
                self.throttle.write(self._file, dataset, array)
        else:
            group.create_dataset("image", data=image, chunks=image_chunks, compression=self.compression)
            group.create_dataset("label", data=label, chunks=label_chunks, compression=self.compression)

    def commit(self) -> Path:
        """Flush and close the temporary file, sync it to disk and rename it to ``path``; returns ``path``.

        Raises:
            DiskFullError: the filesystem is full or failing (the temporary file is removed).
        """
        with self._writing():
            self._close(None)
        return self.path

    def abort(self) -> None:
        """Close and remove the temporary file; ``path`` is left as it was."""
        self._close(_Aborted())

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()  # after commit: nothing to do; the writer's own failures were handled where they happened


class _Aborted(Exception):
    """Thrown into ``atomic_hdf5`` to leave it without committing."""
