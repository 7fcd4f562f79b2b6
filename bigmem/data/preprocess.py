"""Intensity normalisation: one implementation for every path that feeds the network.

Whole-volume training, patches, validation, ``bigmem predict`` and both sides of ``bigmem
compare`` normalise through ``Preprocessing.normalize`` with the same per-case statistics, so a
voxel gets the same value whether it arrives in a whole volume, a patch or a sliding window.
The statistics are those of the case as converted (after resampling, before any crop or pad):
``bigmem convert`` stores them with each case, ``predict`` computes them the same way
(``case_statistics``) for a new scan.

The scheme is chosen per channel from the dataset, as nnU-Net chooses it:

* ``ct``: clip to the 0.5 and 99.5 percentiles of the dataset's foreground voxels, then subtract
  their mean and divide by their standard deviation (nnU-Net's CT normalisation; MLPerf's KiTS19
  reference applies the same kind of figures, fixed: [-79, 304] HU, mean 101.0, std 76.9).
  Values mean the same Hounsfield units in every case, so the statistics are the dataset's.
* ``zscore``: per case and channel, subtract the mean and divide by the standard deviation (MRI,
  whose intensities have no absolute unit).
* ``zscore_nonzero``: the same over the nonzero voxels only (where any channel is nonzero), the
  rest set to 0: for skull-stripped MRI whose zero background would otherwise dominate the
  statistics (nnU-Net uses it where cropping to the nonzero box removes a quarter or more of the
  median case; ``choose_schemes`` applies that rule).
* ``none``: left as stored.

Every scheme is voxel-wise once the statistics are known, so normalising a patch gives exactly
the crop of the normalised whole case. Padding takes ``background``: the value the scheme gives
the case's darkest voxel (0 for ``zscore_nonzero``, the clipped floor for ``ct``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from bigmem.errors import DataError

PREPROCESSING_ATTR = "preprocessing"  # a store's root attribute: ``Preprocessing.to_json``
STATS_ATTR = "intensity_stats"  # a store case's attribute: ``case_statistics`` as JSON
SCHEMES = ("ct", "zscore", "zscore_nonzero", "none")
NORM_EPSILON = 1e-6  # guards the division of a constant channel (nnU-Net uses 1e-8 on float64)
FOREGROUND_PERCENTILES = (0.5, 99.5)  # nnU-Net's CT clipping percentiles
# Foreground values kept per case for the CT statistics: the same number from every case, so each case
# weighs the same in the dataset's figures, as in nnU-Net's fingerprint (fingerprint_extractor.py,
# collect_foreground_intensities: rs.choice(foreground, 1e8 // num_cases, replace=True) per case). bigmem
# takes them at evenly spaced ranks of each channel's sorted foreground instead of at random: the same
# equal weighting without sampling noise, and small enough to keep in the store for --append.
FOREGROUND_SAMPLES_PER_CASE = 10_000
# nnU-Net normalises MRI within the nonzero mask when cropping to the nonzero box keeps less than
# this share of the median case's voxels.
NONZERO_BOX_SHARE = 0.75
_CT_NAME = re.compile(r"(^|[^a-z])ct([^a-z]|$)", re.IGNORECASE)


@dataclass(frozen=True)
class ChannelScheme:
    """How one channel is normalised: a scheme from ``SCHEMES`` and, for ``ct``, the dataset's figures."""

    scheme: str
    low: float | None = None  # ct: clip floor (foreground 0.5 percentile)
    high: float | None = None  # ct: clip ceiling (foreground 99.5 percentile)
    mean: float | None = None  # ct: foreground mean
    std: float | None = None  # ct: foreground standard deviation

    def describe(self) -> str:
        if self.scheme == "ct":
            return (f"ct: clip to [{self.low:.4g}, {self.high:.4g}], then (x - {self.mean:.4g}) / {self.std:.4g} "
                    "(dataset foreground)")
        return {"zscore": "z-score per case", "zscore_nonzero": "z-score per case within the nonzero mask",
                "none": "none"}[self.scheme]


@dataclass(frozen=True)
class Preprocessing:
    """The normalisation of every channel, as a store and a run directory record it (``to_json``)."""

    channels: tuple[ChannelScheme, ...]

    @classmethod
    def default(cls, num_channels: int) -> "Preprocessing":
        """Per-case z-score of every channel: what a store that records no scheme is normalised with."""
        return cls(tuple(ChannelScheme("zscore") for _ in range(num_channels)))

    @classmethod
    def from_json(cls, text: str | bytes | None, num_channels: int, where: str = "") -> "Preprocessing":
        """Read ``to_json``'s text (None: ``default``), checked against ``num_channels``.

        Raises:
            DataError: the text is not a preprocessing record, names an unknown scheme, a ``ct``
                channel lacks its figures, or the channel count differs.
        """
        if text is None:
            return cls.default(num_channels)
        try:
            raw = json.loads(text)
            channels = tuple(ChannelScheme(**entry) for entry in raw["channels"])
        except (ValueError, TypeError, KeyError) as exc:
            raise DataError(f"{where}: its preprocessing record is not readable ({exc}); convert the data again.") \
                from None
        for index, channel in enumerate(channels):
            if channel.scheme not in SCHEMES:
                raise DataError(f"{where}: channel {index}'s normalisation {channel.scheme!r} is not one of "
                                f"{', '.join(SCHEMES)}.")
            if channel.scheme == "ct" and None in (channel.low, channel.high, channel.mean, channel.std):
                raise DataError(f"{where}: channel {index} is normalised as CT but its clip window or statistics "
                                "are missing; convert the data again.")
        if len(channels) != num_channels:
            raise DataError(f"{where}: its preprocessing names {len(channels)} channel"
                            f"{'s' if len(channels) != 1 else ''}; the data has {num_channels}.")
        return cls(channels)

    def to_json(self) -> str:
        return json.dumps({"channels": [asdict(c) for c in self.channels]})

    def describe(self, channel_names: Sequence[str] | None = None) -> list[str]:
        """One line per channel: 'CT: ct: clip to [-79, 304], ...'."""
        names = list(channel_names or [f"channel{i}" for i in range(len(self.channels))])
        return [f"{name}: {channel.describe()}" for name, channel in zip(names, self.channels)]

    def normalize(self, image: np.ndarray, stats: dict) -> np.ndarray:
        """Normalise ``image`` in place with the case's ``stats`` (``case_statistics``); returns it.

        Args:
            image: ``(D, H, W, C)`` float32: a whole case, or any crop of it (a patch, a window).
            stats: the whole case's statistics.

        Returns:
            ``image``, changed in place.
        """
        # of every channel as given, taken before any channel changes
        mask = nonzero_mask(image) if any(c.scheme == "zscore_nonzero" for c in self.channels) else None
        for c, channel in enumerate(self.channels):
            _normalize_channel(image[..., c], channel, stats, c)
            if channel.scheme == "zscore_nonzero":
                image[..., c][~mask] = 0.0
        return image

    def background(self, stats: dict) -> np.ndarray:
        """Per channel, the value padding takes: what the case's darkest voxel becomes (float32).

        Computed by the same float32 operations as ``normalize``, so a padded voxel equals the
        normalised darkest voxel exactly; 0 under ``zscore_nonzero``, as outside its mask.
        """
        values = np.asarray(stats["min"], np.float32).copy()
        for c, channel in enumerate(self.channels):
            _normalize_channel(values[c:c + 1], channel, stats, c)
            if channel.scheme == "zscore_nonzero":
                values[c] = 0.0
        return values


def _normalize_channel(view: np.ndarray, channel: ChannelScheme, stats: dict, c: int) -> None:
    """One channel's normalisation, in place (``view`` float32); the zero outside the nonzero mask is the caller's."""
    if channel.scheme == "ct":
        np.clip(view, channel.low, channel.high, out=view)
        view -= np.float32(channel.mean)
        view *= np.float32(1.0 / max(channel.std, NORM_EPSILON))
    elif channel.scheme == "zscore":
        view -= np.float32(stats["mean"][c])
        view *= np.float32(1.0 / (stats["std"][c] + NORM_EPSILON))
    elif channel.scheme == "zscore_nonzero":
        view -= np.float32(stats["nonzero_mean"][c])
        view *= np.float32(1.0 / (stats["nonzero_std"][c] + NORM_EPSILON))


def nonzero_mask(image: np.ndarray) -> np.ndarray:
    """``(D, H, W)`` bool: voxels where any channel is nonzero (nnU-Net's nonzero mask)."""
    mask = image[..., 0] != 0
    for c in range(1, image.shape[-1]):
        mask |= image[..., c] != 0
    return mask


def case_statistics(image: np.ndarray) -> dict:
    """A case's per-channel statistics, as every normalisation path uses them.

    Computed on the case as converted (after resampling, before any crop or pad), one channel at a
    time: beyond the image, a ``(D, H, W)`` mask and one channel's nonzero voxels (float32) are held,
    never a float64 or whole-image copy. Sums are taken in float64 by einsum (numpy's mean and std
    over the spatial axes took 0.47 s of a 240x240x155x4 case, einsum's sums 0.11 s).

    Args:
        image: ``(D, H, W, C)``, any real dtype.

    Returns:
        ``{"mean", "std", "min", "max", "nonzero_mean", "nonzero_std": one float per channel,
        "nonzero_box": the share of the case's voxels inside the nonzero mask's bounding box}``.

    Raises:
        DataError: the image holds NaN or Inf (its mean is not finite).
    """
    mask = nonzero_mask(image)
    count, inside = max(1, mask.size), int(np.count_nonzero(mask))
    figures = {k: [] for k in ("mean", "std", "min", "max", "nonzero_mean", "nonzero_std")}
    for c in range(image.shape[-1]):  # one channel at a time, as views: never a copy of the whole image
        channel = image[..., c]
        mean, std = _moments(channel, count, "ijk")
        if not np.isfinite(mean):
            raise DataError(f"image has {int(np.count_nonzero(~np.isfinite(image)))} non-finite values (NaN/Inf)")
        figures["mean"].append(mean)
        figures["std"].append(std)
        figures["min"].append(float(channel.min()))
        figures["max"].append(float(channel.max()))
        inner = _moments(channel[mask], inside, "i") if inside else (0.0, 0.0)  # the nonzero voxels, gathered
        figures["nonzero_mean"].append(inner[0])
        figures["nonzero_std"].append(inner[1])
    box = 0.0
    if inside:
        box = 1.0
        for axis in range(3):
            hits = np.flatnonzero(np.any(mask, axis=tuple(a for a in range(3) if a != axis)))
            box *= (hits[-1] - hits[0] + 1) / mask.shape[axis]
    return {**figures, "nonzero_box": float(box)}


def _moments(values: np.ndarray, count: int, axes: str) -> tuple[float, float]:
    """Mean and standard deviation of ``values``, from float64 sums (einsum accumulates without a float64 copy)."""
    total = float(np.einsum(f"{axes}->", values, dtype=np.float64))
    squares = float(np.einsum(f"{axes},{axes}->", values, values, dtype=np.float64))
    mean = total / max(1, count)
    return mean, float(np.sqrt(max(squares / max(1, count) - mean * mean, 0.0)))


REQUIRED_STATS = ("mean", "std", "min", "nonzero_mean", "nonzero_std")


def complete(stats: dict | None, num_channels: int) -> bool:
    """Whether ``stats`` has every figure ``normalize`` and ``background`` need (stores from older
    bigmem versions recorded mean and std only)."""
    return isinstance(stats, dict) and all(
        isinstance(stats.get(k), list) and len(stats[k]) == num_channels
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in stats[k]) for k in REQUIRED_STATS)


def foreground_sample(image: np.ndarray, label: np.ndarray, count: int = FOREGROUND_SAMPLES_PER_CASE) -> np.ndarray:
    """``count`` values of each channel's foreground (label > 0), at evenly spaced ranks: ``(count, C)`` float32.

    Value ``i`` of a channel is its sorted foreground's value at rank ``floor((i + 0.5) / count * n)``
    of ``n`` foreground voxels: every case gives the same number however large its foreground (a
    small one repeats values, as sampling with replacement would), so pooled over cases each weighs
    the same (nnU-Net's fingerprint). ``(0, C)`` for a case without foreground.

    Example:
        >>> foreground_sample(np.arange(4.0).reshape(2, 2, 1, 1), np.ones((2, 2, 1)), count=8)[:, 0]
        array([0., 0., 1., 1., 2., 2., 3., 3.], dtype=float32)
    """
    values = image.reshape(-1, image.shape[-1])[np.flatnonzero(label.reshape(-1))]
    if not len(values):
        return np.zeros((0, image.shape[-1]), np.float32)
    ranks = ((np.arange(count) + 0.5) * len(values) / count).astype(np.int64)
    return np.stack([np.sort(values[:, c])[ranks] for c in range(values.shape[1])], axis=1).astype(np.float32)


def is_ct(name: str) -> bool:
    """Whether a channel name says CT ('CT', 'ct', 'CT_venous'; not 'Tract')."""
    return bool(_CT_NAME.search(name))


def ct_scheme(samples: np.ndarray) -> ChannelScheme:
    """The CT scheme of one channel from its foreground samples (all cases): percentiles, mean, std."""
    low, high = np.percentile(samples, FOREGROUND_PERCENTILES)
    return ChannelScheme("ct", float(low), float(high), float(samples.mean()), float(samples.std()))


def choose_schemes(channel_names: Sequence[str], case_stats: Sequence[dict], samples: Sequence[np.ndarray],
                   requested: str | Sequence[str] = "auto") -> Preprocessing:
    """The dataset's normalisation, per channel, as nnU-Net chooses it.

    Args:
        channel_names: the channels' names (a name saying CT gets ``ct`` under ``auto``).
        case_stats: every case's ``case_statistics``.
        samples: every case's ``foreground_sample`` (``(n, C)``; empty for a case without foreground).
        requested: ``auto`` (default), one of ``SCHEMES`` for every channel, or one per channel.

    Returns:
        The ``Preprocessing``: ``ct`` from the pooled foreground samples; ``zscore_nonzero`` where
        the median case's nonzero box is under ``NONZERO_BOX_SHARE`` of it; else ``zscore``.

    Raises:
        DataError: ``ct`` for a dataset without foreground voxels (no statistics to take).
    """
    pooled = np.concatenate([s for s in samples if len(s)], axis=0) if any(len(s) for s in samples) else None
    boxes = [s["nonzero_box"] for s in case_stats if "nonzero_box" in s]
    mostly_zero = bool(boxes) and float(np.median(boxes)) < NONZERO_BOX_SHARE
    channels = []
    per_channel = [requested] * len(channel_names) if isinstance(requested, str) else list(requested)
    for index, name in enumerate(channel_names):
        scheme = per_channel[index]
        if scheme == "auto":
            scheme = "ct" if is_ct(name) else ("zscore_nonzero" if mostly_zero else "zscore")
        if scheme == "ct":
            if pooled is None:
                raise DataError(f"Channel {name!r}: CT normalisation needs the dataset's foreground voxels, and no "
                                "case has a label above 0; choose {convert.normalization} zscore.")
            channels.append(ct_scheme(pooled[:, index]))
        else:
            channels.append(ChannelScheme(scheme))
    return Preprocessing(tuple(channels))


def storage_dtype(image: np.ndarray, stats: dict) -> np.dtype:
    """The dtype a case's image is stored in: the smallest that keeps what normalisation uses.

    Integer-valued images within int16 (CT in HU, most MRI as scanners write it) are stored as
    int16, exactly. Others as float16 where rounding moves no voxel by more than 1% of its
    channel's spread (the smaller of its standard deviation over the case and over its nonzero
    voxels: z-scores divide by one of them), else float32 (values past float16's range, or
    channels of tiny spread). Checked one channel at a time.
    """
    lowest, highest = min(stats["min"]), max(stats["max"])
    channels = [image[..., c] for c in range(image.shape[-1])]
    if -32768 <= lowest and highest <= 32767 and (
            np.issubdtype(image.dtype, np.integer) or all(np.array_equal(ch, np.round(ch)) for ch in channels)):
        return np.dtype(np.int16)
    if -65504 <= lowest and highest <= 65504:
        for c, channel in enumerate(channels):
            spreads = [v for v in (stats["std"][c], stats["nonzero_std"][c]) if v > 0]
            error = float(np.max(np.abs(channel.astype(np.float16).astype(np.float32) - channel)))
            if error > 0 and error > 0.01 * min(spreads, default=0.0):
                return np.dtype(np.float32)
        return np.dtype(np.float16)
    return np.dtype(np.float32)
