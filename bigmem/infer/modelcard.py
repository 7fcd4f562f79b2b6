"""``preprocessing.json``: what a run's network expects of its input, kept in the run directory.

A trained run predicts on its own: everything ``bigmem predict`` needs to prepare a new scan as
the training cases were prepared lives here, not in the training store (which may be deleted,
or on another machine): the ``--spacing`` and ``--shape`` convert used, the normalisation with
its dataset statistics (``data.preprocess``), the channel and class names and the regions
scored on. ``bigmem train`` writes it when the run starts, from the store it trains on; a run
written before the file existed falls back to its store, where that still exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bigmem.data.preprocess import Preprocessing
from bigmem.errors import DataError
from bigmem.atomic import atomic_write_json
from bigmem.rundir import RunDir

CARD_NAME = "preprocessing.json"
CARD_FORMAT = 1


@dataclass(frozen=True)
class ModelCard:
    """What the network of a run expects: the input preparation and the names of what it predicts.

    Attributes:
        channel_names: the image channels, in order.
        label_names: the classes, in label-value order (background first).
        regions: region name -> the label values it unites (BraTS-style scoring); empty if none.
        spacing: the voxel spacing ``(x, y, z)`` mm cases were resampled to, or None.
        shape: the ``(D, H, W)`` cases were centre-cropped/padded to, or None.
        preprocessing: the intensity normalisation, with the dataset's figures.
        trained_on: the store the run trained on (for the record; never read by predict).
    """

    channel_names: tuple[str, ...]
    label_names: tuple[str, ...]
    preprocessing: Preprocessing
    spacing: tuple[float, float, float] | None = None
    shape: tuple[int, int, int] | None = None
    regions: dict[str, list[int]] = field(default_factory=dict)
    trained_on: str = ""

    @property
    def num_channels(self) -> int:
        return len(self.channel_names)

    @classmethod
    def from_store(cls, path: str | os.PathLike) -> "ModelCard":
        """The card of a model trained on the store at ``path``.

        Raises:
            DataError: the store cannot be opened.
        """
        from bigmem.data.convert import CONVERT_OPTIONS_ATTR
        from bigmem.data.store import HDF5VolumeStore

        with HDF5VolumeStore(path) as store:  # one open: names, schemes, regions and convert's options
            channels, labels, preprocessing, regions = (store.channel_names, store.label_names, store.preprocessing,
                                                        store.regions)
            raw = store.root_attr(CONVERT_OPTIONS_ATTR)
        try:
            options = json.loads(raw) if raw is not None else {}
            spacing, shape = options.get("spacing"), options.get("shape")
        except (TypeError, ValueError, AttributeError):
            raise DataError(f"Store {str(path)!r}: its {CONVERT_OPTIONS_ATTR} attribute is not readable; convert the "
                            "data again.") from None
        return cls(tuple(channels), tuple(labels), preprocessing,
                   None if spacing is None else tuple(float(s) for s in spacing),
                   None if shape is None else tuple(int(s) for s in shape), dict(regions), str(path))

    def to_dict(self) -> dict:
        return {"format": CARD_FORMAT, "channel_names": list(self.channel_names),
                "label_names": list(self.label_names), "regions": self.regions,
                "spacing": None if self.spacing is None else list(self.spacing),
                "shape": None if self.shape is None else list(self.shape),
                "preprocessing": json.loads(self.preprocessing.to_json()), "trained_on": self.trained_on}

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> "ModelCard":
        """Read ``to_dict``'s form.

        Raises:
            DataError: a field is missing or of the wrong form, or the format is newer.
        """
        try:
            if int(raw.get("format", 0)) > CARD_FORMAT:
                raise DataError(f"{where} is of format {raw['format']}, newer than this bigmem reads "
                                f"({CARD_FORMAT}); upgrade bigmem.")
            channels = tuple(str(n) for n in raw["channel_names"])
            labels = tuple(str(n) for n in raw["label_names"])
            preprocessing = Preprocessing.from_json(json.dumps(raw["preprocessing"]), len(channels), where)
            spacing, shape = raw.get("spacing"), raw.get("shape")
            regions = {str(k): [int(v) for v in values] for k, values in (raw.get("regions") or {}).items()}
            return cls(channels, labels, preprocessing,
                       None if spacing is None else tuple(float(s) for s in spacing),
                       None if shape is None else tuple(int(s) for s in shape), regions,
                       str(raw.get("trained_on", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DataError(f"{where} is not a readable preprocessing record ({type(exc).__name__}: {exc}).") from None

    def write(self, run_dir: str | os.PathLike) -> Path:
        """Write the card into ``run_dir`` (atomically)."""
        return atomic_write_json(Path(run_dir) / CARD_NAME, self.to_dict())

    @classmethod
    def of_run(cls, run_dir: str | os.PathLike, store: str | None = None) -> "ModelCard":
        """The card of a run: its ``preprocessing.json``, else (a run from before it) its training store's.

        Args:
            run_dir: the run directory.
            store: the store the run's config names (``data.store``), for a run without the file.

        Raises:
            DataError: no card and no store to read one from, or an unreadable card.
        """
        path = Path(run_dir) / CARD_NAME
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise DataError(f"Cannot read {path}: {exc}.") from None
            if not isinstance(raw, dict):
                raise DataError(f"{path} is not a readable preprocessing record (not a JSON object).")
            return cls.from_dict(raw, str(path))
        if store and Path(store).is_file():
            return cls.from_store(store)
        raise DataError(f"{str(RunDir(run_dir).path)!r} has no {CARD_NAME} (written by bigmem train since it "
                        f"records the preprocessing) and its training store {store!r} is gone: nothing says how to "
                        "prepare a scan for this model. Train it again, or put the training store back at that path.")
