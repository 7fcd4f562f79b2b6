"""Two stand-in datasets for the recipe study, written as nnU-Net v2 raw folders (both tools read the same files).

``brain``: the MNI152 2009c template (its T1 and its grey- and white-matter maps, as nilearn ships them in
its wheel) warped into subjects. Labels: 1 white matter, 2 grey matter (each map above 0.5). Training
subjects come from "scanner A" (pose up to 10 degrees, a mild bias field and noise); unseen subjects from
a shifted "scanner B" (pose up to 25 degrees, blur, more noise, a gamma curve, a stronger bias field and
another gain). Isotropic, ``--brain-mm`` voxels (3 mm: about 60 x 72 x 60).

``organs``: an anisotropic CT-like abdomen drawn from ellipsoids (body, fat, spine, liver, spleen, two
kidneys, gas pockets; portal-venous contrast), 96 x 96 x 28 voxels at 3.5 x 3.5 x 5 mm (nnU-Net calls
it anisotropic: 96 / 28 > 3). Labels: 1 liver, 2 spleen, 3 kidney. Each subject has its own body size,
organ sizes and places and in-plane pose; unseen subjects come from a scanner with more noise, thicker
slices (blur across them) and another contrast phase (organs 20-60 HU brighter).

Every subject is a pure function of (dataset, index, split), so a study that resumes rebuilds the same
files.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

NILEARN = "nilearn==0.14.1"  # its wheel carries the MNI152 2009c template (nilearn/datasets/data/)
MNI_FILES = {"t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
             "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
             "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz"}
SCANNER_A = {"rotation": 10.0, "bias": 0.1, "noise": 0.02, "blur": (0.0, 0.0), "gamma": (1.0, 1.0),
             "gain": (0.9, 1.1)}
SCANNER_B = {"rotation": 25.0, "bias": 0.25, "noise": 0.06, "blur": (0.5, 1.0), "gamma": (0.7, 1.5),
             "gain": (0.75, 1.3)}
ORGANS_SPACING = (3.5, 3.5, 5.0)
ORGANS_SHAPE = (96, 96, 28)


def mni_template(cache: Path, mm: float) -> tuple[np.ndarray, np.ndarray]:
    """The MNI152 T1 (scaled to white matter ~1) and its labels, cropped to the head and resampled to ``mm``."""
    import nibabel as nib
    from scipy import ndimage

    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("nilearn-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", NILEARN, "-d", str(cache)],
                       check=True)
        wheels = sorted(cache.glob("nilearn-*.whl"))
    volumes = {}
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for key, name in MNI_FILES.items():
            raw = gzip.decompress(wheel.read(f"nilearn/datasets/data/{name}"))
            volumes[key] = np.asarray(nib.Nifti1Image.from_bytes(raw).get_fdata(), np.float32)
    head = volumes["t1"] > 0.05 * volumes["t1"].max()
    box = tuple(slice(max(int(i.min()) - 2, 0), int(i.max()) + 3) for i in np.nonzero(head))
    zoom = 1.0 / mm  # the template is at 1 mm
    t1 = ndimage.zoom(volumes["t1"][box], zoom, order=1)
    wm = ndimage.zoom(volumes["wm"][box], zoom, order=1) / volumes["wm"].max()  # the maps are stored 0..255
    gm = ndimage.zoom(volumes["gm"][box], zoom, order=1) / volumes["gm"].max()
    label = np.where((wm > 0.5) & (wm >= gm), 1, np.where(gm > 0.5, 2, 0)).astype(np.uint8)
    return t1 / np.median(t1[label == 1]), label


def _rotation(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rodrigues' rotation matrix about ``axis``."""
    axis = axis / np.linalg.norm(axis)
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * k @ k


def _warp_coords(shape, rng: np.random.Generator, rotation_deg: float, in_plane_axis: int | None = None):
    """Sampling coordinates of one subject: a pose about the centre, a scale, and a smooth ~2-voxel deformation."""
    from scipy import ndimage

    axis = np.eye(3)[in_plane_axis] if in_plane_axis is not None else rng.normal(size=3)
    matrix = _rotation(axis, math.radians(rng.uniform(-rotation_deg, rotation_deg))) * rng.uniform(0.9, 1.1)
    centre = (np.asarray(shape) - 1) / 2
    grid = np.stack(np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij"))
    coords = np.einsum("ij,j...->i...", matrix, grid - centre[:, None, None, None]) + centre[:, None, None, None]
    for a in range(3):
        if a == in_plane_axis:
            continue
        field = ndimage.gaussian_filter(rng.normal(size=shape), sigma=max(shape) / 8)
        coords[a] += 2.0 * field / (np.abs(field).max() + 1e-6)
    return coords


def _scanner(image: np.ndarray, rng: np.random.Generator, scanner: dict, axes_blur=(1, 1, 1)) -> np.ndarray:
    """One scanner's look: gain, a smooth bias field, blur, a gamma curve and noise."""
    from scipy import ndimage

    axes = [np.linspace(-1, 1, s) for s in image.shape]
    grids = np.meshgrid(*axes, indexing="ij")
    phase = sum(rng.uniform(0.5, 1.5) * grids[i] for i in range(3)) + rng.uniform(0, 2 * math.pi)
    image = image * (1.0 + scanner["bias"] * np.sin(phase)) * rng.uniform(*scanner["gain"])
    sigma = rng.uniform(*scanner["blur"])
    if sigma > 0:
        image = ndimage.gaussian_filter(image, [sigma * a for a in axes_blur])
    gamma = rng.uniform(*scanner["gamma"])
    if gamma != 1.0:
        low, high = float(image.min()), float(image.max())
        image = low + (high - low) * ((image - low) / max(high - low, 1e-6)) ** gamma
    return (image + rng.normal(0, scanner["noise"], image.shape)).astype(np.float32)


def brain_subject(template: np.ndarray, label: np.ndarray, index: int, unseen: bool):
    """Subject ``index`` of the brain stand-in: (image, label)."""
    from scipy import ndimage

    scanner = SCANNER_B if unseen else SCANNER_A
    rng = np.random.default_rng([17, index, int(unseen)])
    coords = _warp_coords(template.shape, rng, scanner["rotation"])
    image = ndimage.map_coordinates(template, coords, order=1, mode="constant", cval=0.0)
    warped = ndimage.map_coordinates(label, coords, order=0, mode="constant", cval=0).astype(np.uint8)
    return _scanner(image, rng, scanner), warped


def _ellipsoid(grid, centre, radii) -> np.ndarray:
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) <= 1.0


def organs_subject(index: int, unseen: bool):
    """Subject ``index`` of the CT-like stand-in: (image in HU, label), axes (x, y, z) at ``ORGANS_SPACING``."""
    from scipy import ndimage

    rng = np.random.default_rng([23, index, int(unseen)])
    x, y, z = [(np.arange(n) - (n - 1) / 2) * s for n, s in zip(ORGANS_SHAPE, ORGANS_SPACING)]
    angle = math.radians(rng.uniform(-20, 20) if unseen else rng.uniform(-10, 10))
    gx, gy, gz = np.meshgrid(x, y, z, indexing="ij")
    gx, gy = gx * math.cos(angle) - gy * math.sin(angle), gx * math.sin(angle) + gy * math.cos(angle)
    grid = (gx, gy, gz)
    size = rng.uniform(0.85, 1.15)

    def jitter(centre, radii):
        return ([c * size + rng.uniform(-12, 12) for c in centre], [r * size * rng.uniform(0.85, 1.15) for r in radii])

    image = np.full(ORGANS_SHAPE, -1000.0, np.float32)
    label = np.zeros(ORGANS_SHAPE, np.uint8)
    body = _ellipsoid(grid[:2], (0, 0), (150 * size, 110 * size))
    image[body] = -100.0  # fat
    image[_ellipsoid(grid[:2], (0, 0), (135 * size, 95 * size)) & body] = 50.0  # muscle and soft tissue
    image[_ellipsoid(grid[:2], (0, 55 * size), (18 * size, 18 * size)) & body] = 400.0  # spine
    phase = rng.uniform(20, 60) if unseen else 0.0
    # portal-venous contrast: liver, spleen and kidneys stand apart from muscle (50 HU) by tens of HU
    organs = [(1, (-60, -10, 10), (70, 55, 60), 110.0), (2, (75, 30, 25), (35, 30, 45), 140.0),
              (3, (-55, 45, -25), (25, 20, 40), 190.0), (3, (55, 45, -30), (25, 20, 40), 190.0)]
    for value, centre, radii, hu in organs:
        where = _ellipsoid(grid, *jitter(centre, radii)) & body
        label[where] = value
        image[where] = hu + phase
    for _ in range(6):  # gas in the bowel
        centre = (rng.uniform(-40, 40) * size, rng.uniform(-60, 0) * size, rng.uniform(-60, 60))
        image[_ellipsoid(grid, centre, (12, 12, 15)) & (label == 0) & body] = -600.0
    noise, blur = (20.0, (0.7, 0.7, 1.2)) if unseen else (8.0, (0.4, 0.4, 0.4))
    image = ndimage.gaussian_filter(image, blur) + rng.normal(0, noise, ORGANS_SHAPE)
    return image.astype(np.float32), label


def write_dataset(root: Path, name: str, *, train: int = 4, unseen: int = 4, brain_mm: float = 3.0,
                  cache: Path | None = None) -> Path:
    """Write the stand-in ``name`` (brain or organs) as nnU-Net v2 raw folder ``root``; returns ``root``.

    imagesTr/labelsTr hold the training subjects (``train_XX``), imagesTs/labelsTs the unseen ones (``unseen_XX``).
    A folder whose dataset.json exists is kept as it is.
    """
    import nibabel as nib

    if (root / "dataset.json").exists():
        return root
    for sub in ("imagesTr", "labelsTr", "imagesTs", "labelsTs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    if name == "brain":
        template, template_label = mni_template(cache or root.parent / "cache", brain_mm)
        spacing = (brain_mm,) * 3
        make = lambda index, held: brain_subject(template, template_label, index, held)  # noqa: E731
        labels, channel = {"background": 0, "white_matter": 1, "grey_matter": 2}, "MRI"
    elif name == "organs":
        spacing, make = ORGANS_SPACING, organs_subject
        labels, channel = {"background": 0, "liver": 1, "spleen": 2, "kidney": 3}, "CT"
    else:
        raise ValueError(f"unknown stand-in {name!r}: expected brain or organs")
    affine = np.diag([*spacing, 1.0])
    for held, count, split in ((False, train, "Tr"), (True, unseen, "Ts")):
        for index in range(count):
            image, label = make(index, held)
            case = f"{'unseen' if held else 'train'}_{index:02d}"
            nib.save(nib.Nifti1Image(image, affine), root / f"images{split}" / f"{case}_0000.nii.gz")
            nib.save(nib.Nifti1Image(label, affine), root / f"labels{split}" / f"{case}.nii.gz")
    metadata = {"channel_names": {"0": channel}, "labels": labels, "numTraining": train, "file_ending": ".nii.gz",
                "description": __doc__.split("\n\n")[1 if name == "brain" else 2].replace("\n", " ")}
    (root / "dataset.json.tmp").write_text(json.dumps(metadata, indent=2))
    (root / "dataset.json.tmp").rename(root / "dataset.json")
    return root


def main(argv=None) -> int:
    """``python benchmarks/proofs/standins.py [brain] [organs] --out DIR``: the stand-ins as nnU-Net raw folders."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=["brain", "organs"], choices=["brain", "organs"])
    parser.add_argument("--out", type=Path, default=Path("standins"), help="folder for DatasetXXX_<name> folders")
    parser.add_argument("--brain-mm", type=float, default=3.0, help="the brain stand-in's voxel edge (default 3)")
    args = parser.parse_args(argv)
    for name in args.names:
        dataset = {"brain": 901, "organs": 902}[name]
        print(write_dataset(args.out / f"Dataset{dataset}_{name}", name, brain_mm=args.brain_mm,
                            cache=args.out / "cache"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
