"""HD95 on a KiTS-sized pair: bigmem's k-d tree against a distance transform over the bounding box.

    python benchmarks/proofs/bench_hd95.py [--shape 512,512,211] [--repeats 3] [--warmup 0] [--quick] [--out DIR]

Two kidney-like masks (two ellipsoids each, the prediction shifted and eroded so the surfaces
differ) in a 512x512x211 volume at 0.8x0.8x3.0 mm, as KiTS19 ships; the prediction also has a
small false positive near a corner, as a model early in training has, which stretches the joint
bounding box over most of the volume (``--no-false-positive``: the kidneys' box alone). Times,
side by side in one run (median and range of ``--repeats``, after ``--warmup`` untimed calls):

- ``bigmem``: ``infer.metrics.hausdorff95_mm`` (surfaces on the joint bounding box, then nearest
  surface points through a k-d tree);
- ``distance_transform``: the same surfaces, then SciPy's Euclidean feature transform over the
  whole box for each direction (what bigmem did before, and MONAI's and nnU-Net's way).

Both must give the same distance (it prints both). Writes ``hd95-<machine>-<time>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, command_line, time_calls, write_results
from rich.console import Console
from rich.table import Table

from bigmem.infer.metrics import HD_PERCENTILE, _bounding_box, _surface, hausdorff95_mm

SPACING = (0.8, 0.8, 3.0)


def kidneys(shape, shift: int, erode: int) -> np.ndarray:
    """Two ellipsoid blobs (kidney-sized at KiTS spacing), shifted by ``shift`` voxels and eroded ``erode`` times."""
    from scipy import ndimage

    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    mask = np.zeros(shape, bool)
    for centre_y in (0.32, 0.68):
        centre = (shape[0] * 0.5 + shift, shape[1] * centre_y, shape[2] * 0.5)
        radii = (shape[0] * 0.09, shape[1] * 0.07, shape[2] * 0.2)
        mask |= sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) < 1.0
    return ndimage.binary_erosion(mask, iterations=erode) if erode else mask


def distance_transform_hd95(ref: np.ndarray, pred: np.ndarray, spacing) -> float:
    """The reference: the same surfaces and crop, each direction through SciPy's feature transform of the box."""
    from scipy import ndimage

    spacing = np.asarray(spacing, np.float64)
    (lo_r, hi_r), (lo_p, hi_p) = _bounding_box(ref), _bounding_box(pred)
    lo = np.maximum(np.minimum(lo_r, lo_p) - 1, 0)
    hi = np.minimum(np.maximum(hi_r, hi_p) + 1, ref.shape)
    crop = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    surfaces = _surface(ref[crop]), _surface(pred[crop])
    results = []
    for source, target in (surfaces, surfaces[::-1]):
        indices = ndimage.distance_transform_edt(~target, sampling=spacing, return_distances=False,
                                                 return_indices=True)
        points = np.nonzero(source)
        squared = sum(((indices[axis][points] - coords) * spacing[axis]) ** 2 for axis, coords in enumerate(points))
        results.append(np.percentile(np.sqrt(squared), HD_PERCENTILE))
    return float(max(results))


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=3, warmup=0, quick={"shape": "64,64,32", "repeats": 1})
    parser.add_argument("--shape", default="512,512,211")
    parser.add_argument("--no-false-positive", action="store_true", help="no stray blob in the prediction")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    shape = tuple(int(s) for s in args.shape.split(","))
    ref, pred = kidneys(shape, 0, 0), kidneys(shape, 3, 2)
    if not args.no_false_positive:
        pred[10:16, 10:16, 5:8] = True
    box = _bounding_box(ref | pred)
    box_voxels = int(np.prod(box[1] - box[0]))
    rows = {}
    for name, fn in (("bigmem", lambda: hausdorff95_mm(ref, pred, SPACING)),
                     ("distance_transform", lambda: distance_transform_hd95(ref, pred, SPACING))):
        timed = time_calls(fn, repeats=args.repeats, warmup=args.warmup)
        rows[name] = {"hd95_mm": timed.value, **timed.spread.as_dict()}
    table = Table(title=f"HD95 of a {'x'.join(map(str, shape))} pair at {SPACING} mm (box {box_voxels:,} voxels)")
    for column in ("method", "HD95 mm", "median s", "range s"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        table.add_row(name, f"{row['hd95_mm']:.4f}", f"{row['median_s']:.3f}",
                      f"{row['min_s']:.3f}-{row['max_s']:.3f}")
    console.print(table)
    speedup = rows["distance_transform"]["median_s"] / rows["bigmem"]["median_s"]
    console.print(f"k-d tree {speedup:.1f}x faster; equal distances: "
                  f"{np.isclose(rows['bigmem']['hd95_mm'], rows['distance_transform']['hd95_mm'])}")
    write_results("hd95", {"command": command_line(__file__, argv),
                           "shape": list(shape), "spacing_mm": list(SPACING), "box_voxels": box_voxels,
                           "false_positive": not args.no_false_positive, "ref_voxels": int(ref.sum()),
                           "pred_voxels": int(pred.sum()), "rows": rows,
                           "speedup": speedup}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
