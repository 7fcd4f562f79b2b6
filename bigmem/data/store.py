"""The HDF5 store format (DESIGN.md) and ``HDF5VolumeStore``, its reader.

Layout: ``/cases/<case_id>/image`` (D, H, W, C) and ``/cases/<case_id>/label`` (D, H, W) uint8.
Case attributes: ``spacing``, ``affine``, ``source_affine``, ``source_image``, ``source_label``.
Root attributes: ``bigmem_store_version``, ``num_classes``, ``channel_names``, ``label_names``.

h5py serialises every call behind one global lock and a file handle must never cross a fork:
a store is opened in the process that reads it, and reopened if the process id changes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

from bigmem.errors import DataError
from bigmem.units import format_bytes

STORE_VERSION = 1
# Whole-volume reads touch every chunk of a case; 64^3 voxels (1 MiB of float32 per channel)
# keeps the per-chunk overhead small while letting partial (patch) reads skip most of a case.
DEFAULT_CHUNK_EDGE = 64


@dataclass(frozen=True)
class CaseInfo:
    case_id: str
    shape: tuple[int, int, int]
    num_channels: int
    image_dtype: str


class HDF5VolumeStore:
    """Read-only access to a bigmem store; checks the layout when opened, the values when read."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._pid = -1
        handle = self._handle()
        self.num_classes = int(handle.attrs["num_classes"])
        self.channel_names = [str(n) for n in handle.attrs.get("channel_names", [])]
        self.label_names = [str(n) for n in handle.attrs.get("label_names", [])]
        self.cases = self._check_layout(handle)

    # ---- opening -------------------------------------------------------------------------

    def _handle(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file = self._open()
            self._pid = os.getpid()
        return self._file

    def _open(self) -> h5py.File:
        if not self.path.exists():
            raise DataError(f"Cannot open store {str(self.path)!r}: no such file. Create one with "
                            "'bigmem synth' or 'bigmem convert'.")
        try:
            handle = h5py.File(self.path, "r")
        except OSError as exc:
            raise DataError(f"Cannot open store {str(self.path)!r}: not a readable HDF5 file ({exc}).") from None
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
        return [c.case_id for c in self.cases]

    @property
    def num_channels(self) -> int:
        return self.cases[0].num_channels

    @property
    def nbytes(self) -> int:
        """Bytes of all images (float32) and labels (uint8) once read into memory."""
        return sum(int(np.prod(c.shape)) * (4 * c.num_channels + 1) for c in self.cases)

    def read_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray]:
        """The image (float32, D,H,W,C) and label (uint8, D,H,W) of one case, checked."""
        handle = self._handle()
        try:
            case = handle["cases"][case_id]
            image = np.asarray(case["image"][...], dtype=np.float32)
            label = np.asarray(case["label"][...])
        except KeyError:
            raise DataError(f"Case {case_id!r} is not in store {str(self.path)!r}.") from None
        except OSError as exc:
            raise DataError(f"Case {case_id!r}: cannot read from {str(self.path)!r} ({exc}); the store may be "
                            "truncated or corrupt.") from None
        bad = np.count_nonzero(~np.isfinite(image))
        if bad:
            raise DataError(f"Case {case_id!r}: image has {bad} non-finite values (NaN/Inf) ({self.path}); "
                            "fix the source and convert again.")
        if label.size and int(label.max()) >= self.num_classes:
            raise DataError(f"Case {case_id!r}: label value {int(label.max())} >= number of classes "
                            f"{self.num_classes} ({self.path}); expected values 0..{self.num_classes - 1}.")
        return image, label.astype(np.uint8, copy=False)

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None

    def __enter__(self) -> "HDF5VolumeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):  # a handle never crosses a process boundary
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, -1
        return state

    def __len__(self) -> int:
        return len(self.cases)

    def __iter__(self) -> Iterator[str]:
        return iter(self.case_ids)

    def __repr__(self) -> str:
        return (f"HDF5VolumeStore({str(self.path)!r}; cases: {len(self.cases)}; channels: {self.num_channels}; "
                f"classes: {self.num_classes}; memory: {format_bytes(self.nbytes)})")


class StoreWriter:
    """Writes a store under a temporary name and renames it into place on ``commit``.

    Used as a context manager: an exception (or a missing commit) removes the temporary file,
    so a half-written store never stays behind.
    """

    def __init__(self, path: str | os.PathLike, *, num_classes: int, channel_names: Sequence[str],
                 label_names: Sequence[str] | None = None, compression: str | None = None,
                 chunk_edge: int | None = DEFAULT_CHUNK_EDGE, append: bool = False):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.compression = compression
        self.chunk_edge = chunk_edge  # None: contiguous datasets (readable at their file offset)
        self.num_channels = len(channel_names)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:  # work on a copy: the original stays intact until the rename
            shutil.copyfile(self.path, self.tmp_path)
            self._file = h5py.File(self.tmp_path, "r+")
            self._cases = self._file.require_group("cases")
            return
        self._file = h5py.File(self.tmp_path, "w")
        self._file.attrs["bigmem_store_version"] = STORE_VERSION
        self._file.attrs["num_classes"] = int(num_classes)
        self._file.attrs["channel_names"] = [str(n) for n in channel_names]
        self._file.attrs["label_names"] = [str(n) for n in (label_names or
                                                            [f"class{i}" for i in range(num_classes)])]
        self._cases = self._file.create_group("cases")

    @property
    def case_ids(self) -> list[str]:
        return list(self._cases)

    def set_root_attr(self, name: str, value) -> None:
        self._file.attrs[name] = value

    def add_case(self, case_id: str, image: np.ndarray, label: np.ndarray, *,
                 spacing: Sequence[float] = (1.0, 1.0, 1.0), affine: np.ndarray | None = None,
                 source_affine: np.ndarray | None = None, source_image: str = "", source_label: str = "",
                 attrs: dict | None = None) -> None:
        if image.ndim == 3:
            image = image[..., np.newaxis]
        if image.shape[:3] != label.shape or image.shape[3] != self.num_channels:
            raise DataError(f"Case {case_id!r}: image shape {image.shape} does not match label shape "
                            f"{label.shape} with {self.num_channels} channels.")
        if case_id in self._cases:
            raise DataError(f"Case {case_id!r} appears twice.")
        group = self._cases.create_group(case_id)
        if self.chunk_edge is None and self.compression is None:
            image_chunks = label_chunks = None  # contiguous
        else:
            edge = self.chunk_edge or DEFAULT_CHUNK_EDGE  # HDF5 compresses chunked datasets only
            label_chunks = tuple(min(s, edge) for s in label.shape)
            image_chunks = label_chunks + (image.shape[3],)
        group.create_dataset("image", data=image, chunks=image_chunks, compression=self.compression)
        group.create_dataset("label", data=label.astype(np.uint8), chunks=label_chunks, compression=self.compression)
        for name, value in (attrs or {}).items():
            group.attrs[name] = value
        affine = np.eye(4) if affine is None else np.asarray(affine, dtype=np.float64)
        group.attrs["spacing"] = np.asarray(spacing, dtype=np.float64)
        group.attrs["affine"] = affine
        group.attrs["source_affine"] = affine if source_affine is None else np.asarray(source_affine, np.float64)
        group.attrs["source_image"] = source_image
        group.attrs["source_label"] = source_label

    def commit(self) -> Path:
        self._file.close()
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> None:
        if self._file.id.valid:
            self._file.close()
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self.tmp_path.exists():
            self.abort()
