"""bigmem's whole-case U-Net topology beside nnU-Net v2's 3d_fullres plan, on the same NIfTI files.

    python benchmarks/tables/bench_topology.py [--nnunet-python PATH] [--work DIR] [--only NAME] [--quick] [--out DIR]

Writes three synthetic nnU-Net v2 raw datasets (imagesTr/labelsTr NIfTI + dataset.json, diagonal
affines, so a file's axes are the canonical (x, y, z)):

- ``brain``: 5 isotropic 1 mm MRI-like heads of about 160x192x160 voxels inside a zero background
  (skull-stripped: cropping to the nonzero box matters);
- ``kits``: 8 CT-like cases of 256x256 voxels in-plane at 0.78-0.82 mm, 33 to 120 slices of mostly
  3 mm (one of 2.5 mm, one of 5 mm): the anisotropy rule takes the 10th percentile;
- ``prostate``: 6 MRI-like cases of 320x320 voxels at 0.6 mm, 18 to 24 slices of 3-4 mm.

bigmem reads each through ``bigmem convert``'s API into a store, ``bigmem.data.fingerprint`` (shapes
cropped to the nonzero box, as nnU-Net's fingerprint takes them, and as stored) and
``bigmem.config.topology``: the target spacing, the median case there, and its stages. nnU-Net,
through ``--nnunet-python`` (a Python with nnunetv2 installed, default /work/nnunet-venv/bin/python;
missing: bigmem's side only, and the script says so), runs ``nnUNetv2_extract_fingerprint
--verify_dataset_integrity`` and ``nnUNetv2_plan_experiment`` (default planner, then ResEnc M and L)
with nnUNet_raw/_preprocessed/_results in the work folder, and its own ``get_pool_and_conv_props``
on bigmem's whole median case.

Every figure is printed in bigmem's axis order (D, H, W), the store's, which is the files' (x, y,
z); nnU-Net's (its ``z, y, x`` reading, then ``transpose_forward``) are mapped back. The checks that
must hold: the same fingerprint, target spacing and median shape as nnU-Net's plan, and the same
per-axis kernels and strides as nnU-Net's function on the same whole case. nnU-Net's own 3d_fullres
plan differs where its GPU memory target shrank the patch; benchmarks/results/topology.md says why.
Prints a table per dataset and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, command_line, write_results

DEFAULT_NNUNET_PYTHON = "/work/nnunet-venv/bin/python"

# name -> (dataset id, channel name, cases: (shape (x, y, z), spacing (x, y, z) mm))
DATASETS = {
    "brain": (991, "T1", [((176, 208, 176), (1.0, 1.0, 1.0)), ((172, 206, 172), (1.0, 1.0, 1.0)),
                          ((180, 212, 178), (1.0, 1.0, 1.0)), ((168, 200, 170), (1.0, 1.0, 1.0)),
                          ((184, 216, 180), (1.0, 1.0, 1.0))]),
    "kits": (992, "CT", [((256, 256, 33), (0.78, 0.78, 3.0)), ((256, 256, 48), (0.8, 0.8, 3.0)),
                         ((256, 256, 60), (0.82, 0.82, 3.0)), ((256, 256, 75), (0.8, 0.8, 5.0)),
                         ((256, 256, 90), (0.78, 0.78, 3.0)), ((256, 256, 100), (0.8, 0.8, 2.5)),
                         ((256, 256, 110), (0.8, 0.8, 3.0)), ((256, 256, 120), (0.82, 0.82, 3.0))]),
    "prostate": (993, "T2", [((320, 320, 18), (0.6, 0.6, 4.0)), ((320, 320, 20), (0.6, 0.6, 3.6)),
                             ((320, 320, 20), (0.6, 0.6, 3.6)), ((320, 320, 22), (0.6, 0.6, 3.0)),
                             ((320, 320, 19), (0.6, 0.6, 3.6)), ((320, 320, 24), (0.6, 0.6, 3.6))]),
}
NAMES = {"brain": "BrainLike", "kits": "KiTSLike", "prostate": "ProstateLike"}
# row -> (planner class, plans file, its max_dataset_covered: the ResEnc M/L/XL planners set 1)
PLANNERS = {"nnU-Net 3d_fullres plan": ("ExperimentPlanner", "nnUNetPlans", 0.05),
            "nnU-Net ResEnc M plan": ("nnUNetPlannerResEncM", "nnUNetResEncUNetMPlans", 1.0),
            "nnU-Net ResEnc L plan": ("nnUNetPlannerResEncL", "nnUNetResEncUNetLPlans", 1.0)}

# nnU-Net's get_pool_and_conv_props on one (spacing, shape), in its own axis order; JSON in argv, JSON out.
POOL_CODE = """
import json, sys
from nnunetv2.experiment_planning.experiment_planners.network_topology import get_pool_and_conv_props
spacing, shape = json.loads(sys.argv[1])
_, strides, kernels, patch, divisors = get_pool_and_conv_props(spacing, shape, 4, 999999)
print(json.dumps({"strides": strides, "kernel_sizes": kernels, "patch_size": [int(p) for p in patch],
                  "divisors": [int(d) for d in divisors]}))
"""


# ---- the datasets --------------------------------------------------------------------------------------


def _ellipsoid(shape, centre, radii) -> np.ndarray:
    axes = [((np.arange(n) - c) / r) ** 2 for n, c, r in zip(shape, centre, radii)]
    return (axes[0][:, None, None] + axes[1][None, :, None] + axes[2][None, None, :]) <= 1.0


def make_case(kind: str, shape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic case (image int16, label uint8) of ``shape`` (x, y, z)."""
    centre = [n / 2 for n in shape]
    if kind == "brain":  # a head of nonzero MRI values in a zero background, 8 voxels in from each side
        head = _ellipsoid(shape, centre, [n / 2 - 8 for n in shape])
        image = np.where(head, np.clip(rng.normal(100, 15, shape), 1, None), 0)
        label = _ellipsoid(shape, centre, [n / 8 for n in shape]).astype(np.uint8)
    elif kind == "kits":  # air at -1000 HU around a body of soft tissue: nonzero everywhere
        body = _ellipsoid(shape, centre, [shape[0] * 0.45, shape[1] * 0.35, shape[2] * 10])
        image = np.where(body, rng.normal(40, 20, shape), -1000)
        label = _ellipsoid(shape, [shape[0] * 0.3, shape[1] * 0.5, shape[2] / 2],
                           [shape[0] * 0.06, shape[1] * 0.08, max(2.0, shape[2] * 0.2)]).astype(np.uint8)
    else:  # prostate: Rician-like MRI background, never zero, a brighter gland
        gland = _ellipsoid(shape, centre, [shape[0] * 0.1, shape[1] * 0.08, max(2.0, shape[2] * 0.3)])
        image = np.abs(rng.normal(20, 8, shape)) + 1 + np.where(gland, 120, 0)
        label = gland.astype(np.uint8)
    return np.round(image).astype(np.int16), label


def write_dataset(root: Path, kind: str, cases) -> Path:
    """An nnU-Net v2 raw dataset of ``cases`` under ``root``; returns its folder."""
    import nibabel as nib

    dataset_id, channel, _ = DATASETS[kind]
    folder = root / f"Dataset{dataset_id}_{NAMES[kind]}"
    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    rng = np.random.default_rng(dataset_id)
    for index, (shape, spacing) in enumerate(cases):
        image, label = make_case(kind, shape, rng)
        affine = np.diag([*spacing, 1.0])
        nib.save(nib.Nifti1Image(image, affine), str(folder / "imagesTr" / f"{kind}_{index:03d}_0000.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(folder / "labelsTr" / f"{kind}_{index:03d}.nii.gz"))
    (folder / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": channel}, "labels": {"background": 0, "target": 1},
        "numTraining": len(cases), "file_ending": ".nii.gz"}, indent=1))
    return folder


def chosen_cases(cases, count: int | None, small: bool):
    """The first ``count`` cases (all: None), in-plane sizes halved with ``small`` (the spacings kept)."""
    return [((x // 2, y // 2, z) if small else (x, y, z), spacing) for (x, y, z), spacing in cases[:count]]


# ---- bigmem's side -------------------------------------------------------------------------------------


def bigmem_rows(folder: Path, store: Path) -> tuple[dict, dict]:
    """Convert, fingerprint (cropped, as stored) and plan: (rows by name, the cropped fingerprint as JSON)."""
    from bigmem.api import convert
    from bigmem.config.topology import batch_cap
    from bigmem.data.fingerprint import fingerprint

    convert(folder, store)
    rows = {}
    cropped = fingerprint(store, crop_to_nonzero=True)
    stored = fingerprint(store)
    for name, fp in (("bigmem whole case (nonzero crop)", cropped), ("bigmem whole case (as stored)", stored)):
        topology = fp.topology()
        if name.endswith("(as stored)") and fp.shapes == cropped.shapes:
            continue  # nothing to crop: the same row
        rows[name] = {"spacing": list(topology.spacing), "median_shape": list(topology.median_shape),
                      "kernel_sizes": [list(k) for k in topology.kernel_sizes],
                      "strides": [list(s) for s in topology.strides], "features": list(topology.features),
                      "patch_size": list(topology.padded_shape), "stages": topology.stages,
                      "batch": f"cap {batch_cap(fp.dataset_voxels(), float(np.prod(topology.padded_shape)))}",
                      "dataset_voxels": fp.dataset_voxels(), "model_table": topology.to_model_table()}
    return rows, cropped.to_json()


# ---- nnU-Net's side ------------------------------------------------------------------------------------


def to_bigmem(triple, transpose_forward) -> list:
    """A triple in nnU-Net's plan axes -> bigmem's (D, H, W): plan axis p is nnU-Net's read axis
    transpose_forward[p], which is the file's (and bigmem's) axis 2 - transpose_forward[p]."""
    out = [None] * 3
    for axis, value in enumerate(triple):
        out[2 - transpose_forward[axis]] = value
    return out


def to_nnunet(triple, transpose_forward) -> list:
    """A triple in bigmem's (D, H, W) -> nnU-Net's plan axes (``to_bigmem``'s inverse)."""
    return [triple[2 - transpose_forward[axis]] for axis in range(3)]


def nnunet_env(work: Path) -> dict:
    return dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "preprocessed"),
                nnUNet_results=str(work / "results"), OMP_NUM_THREADS="1", nnUNet_n_proc_DA="1")


def run_nnunet(python: str, work: Path, dataset_id: int) -> None:
    """nnU-Net's fingerprint (with its integrity check) and its plans: default, ResEnc M, ResEnc L."""
    bin_dir = Path(python).parent
    env = nnunet_env(work)
    steps = [[str(bin_dir / "nnUNetv2_extract_fingerprint"), "-d", str(dataset_id), "-np", "1",
              "--verify_dataset_integrity", "--no_pbar"]]
    steps += [[str(bin_dir / "nnUNetv2_plan_experiment"), "-d", str(dataset_id), "-pl", planner]
              for planner, _, _ in PLANNERS.values()]
    for step in steps:
        done = subprocess.run(step, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(step)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")


def nnunet_pool(python: str, work: Path, spacing, shape) -> dict:
    """nnU-Net's get_pool_and_conv_props on (spacing, shape), given and returned in nnU-Net's plan axes."""
    done = subprocess.run([python, "-c", POOL_CODE, json.dumps([list(spacing), list(shape)])], env=nnunet_env(work),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def nnunet_rows(python: str, work: Path, kind: str, bigmem_row: dict) -> tuple[dict, dict]:
    """nnU-Net's rows (its function on bigmem's whole case, its plans), in bigmem's axes; and its fingerprint."""
    from bigmem.config.topology import batch_cap

    dataset_id = DATASETS[kind][0]
    preprocessed = work / "preprocessed" / f"Dataset{dataset_id}_{NAMES[kind]}"
    run_nnunet(python, work, dataset_id)
    fingerprint = json.loads((preprocessed / "dataset_fingerprint.json").read_text())
    rows = {}
    for name, (_, plans_name, covered) in PLANNERS.items():
        plans = json.loads((preprocessed / f"{plans_name}.json").read_text())
        forward = plans["transpose_forward"]
        fullres = plans["configurations"]["3d_fullres"]
        arch = fullres["architecture"]["arch_kwargs"]
        if name == "nnU-Net 3d_fullres plan":  # nnU-Net's own function, on bigmem's whole median case
            pool = nnunet_pool(python, work, to_nnunet(bigmem_row["spacing"], forward),
                               to_nnunet(bigmem_row["median_shape"], forward))
            rows["nnU-Net rules, same whole case"] = {
                "spacing": bigmem_row["spacing"], "median_shape": bigmem_row["median_shape"],
                "kernel_sizes": [to_bigmem(k, forward) for k in pool["kernel_sizes"]],
                "strides": [to_bigmem(s, forward) for s in pool["strides"]],
                "features": [],  # the function sets no features: the plan rows show nnU-Net's
                "patch_size": to_bigmem(pool["patch_size"], forward), "stages": len(pool["strides"]), "batch": ""}
        dataset_voxels = float(np.prod(fullres["median_image_size_in_voxels"], dtype=np.float64)
                               * plans_json_cases(preprocessed))
        rows[name] = {"spacing": to_bigmem(fullres["spacing"], forward),
                      "median_shape": to_bigmem(fullres["median_image_size_in_voxels"], forward),
                      "kernel_sizes": [to_bigmem(k, forward) for k in arch["kernel_sizes"]],
                      "strides": [to_bigmem(s, forward) for s in arch["strides"]],
                      "features": list(arch["features_per_stage"]), "patch_size": to_bigmem(fullres["patch_size"],
                                                                                            forward),
                      "stages": arch["n_stages"], "batch": str(fullres["batch_size"]),
                      "cap_at_its_patch": batch_cap(dataset_voxels, float(np.prod(fullres["patch_size"])),
                                                    max_dataset_covered=covered),
                      "transpose_forward": forward, "configurations": sorted(plans["configurations"]),
                      "encoder_blocks": arch.get("n_blocks_per_stage", arch.get("n_conv_per_stage")),
                      "decoder_convs": arch.get("n_conv_per_stage_decoder")}
    return rows, fingerprint


def plans_json_cases(preprocessed: Path) -> int:
    """numTraining of the dataset.json nnU-Net copied beside its plans."""
    return int(json.loads((preprocessed / "dataset.json").read_text())["numTraining"])


# ---- the checks and the table ----------------------------------------------------------------------------


def checks(rows: dict, ours: dict, theirs: dict | None) -> dict:
    """What must agree: fingerprint, target spacing, median shape (nnU-Net's plan); stages (nnU-Net's function)."""
    if theirs is None:
        return {}
    mine = rows["bigmem whole case (nonzero crop)"]
    rules = rows["nnU-Net rules, same whole case"]
    plan = rows["nnU-Net 3d_fullres plan"]
    pairs = sorted(zip(map(tuple, ours["spacings"]), map(tuple, ours["shapes_after_crop"])))
    nnunet_pairs = sorted(zip((tuple(s[::-1]) for s in theirs["spacings"]),
                              (tuple(s[::-1]) for s in theirs["shapes_after_crop"])))
    return {"fingerprint (spacings, cropped shapes)": pairs == [(tuple(map(float, s)), tuple(map(int, n)))
                                                             for s, n in nnunet_pairs],
            "target spacing": np.allclose(mine["spacing"], plan["spacing"], rtol=0, atol=1e-9),
            "median shape": list(mine["median_shape"]) == [float(s) for s in plan["median_shape"]],
            "kernels per stage per axis": mine["kernel_sizes"] == [list(k) for k in rules["kernel_sizes"]],
            "strides per stage per axis": mine["strides"] == [list(s) for s in rules["strides"]],
            "padded shape": list(mine["patch_size"]) == list(rules["patch_size"])}


def _stages(triples) -> str:
    return " ".join("".join(str(v) for v in t) for t in triples)


def _shape(values) -> str:
    return "x".join(f"{v:g}" for v in values)


def print_table(console, kind: str, rows: dict, passed: dict) -> None:
    from rich.table import Table

    title = (f"{kind}: each stage's kernel and stride as D H W digits (bigmem's axes; the files' x y z); "
             "patch: padded to the divisors")
    table = Table(title=title)
    for column in ("", "spacing mm", "median shape", "stages", "kernels", "strides", "features", "patch", "batch"):
        table.add_column(column, justify="left" if column in ("", "kernels", "strides") else "right")
    for name, row in rows.items():
        table.add_row(name, _shape(np.round(row["spacing"], 5)), _shape(row["median_shape"]), str(row["stages"]),
                      _stages(row["kernel_sizes"]), _stages(row["strides"]),
                      ",".join(str(f) for f in row["features"]), _shape(row["patch_size"]), row["batch"])
    console.print(table)
    for what, ok in passed.items():
        console.print(f"  {'same' if ok else 'DIFFERENT'}: {what}")


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"cases": 3, "small": True})
    parser.add_argument("--nnunet-python", default=DEFAULT_NNUNET_PYTHON,
                        help=f"a Python with nnunetv2 installed (default {DEFAULT_NNUNET_PYTHON}); "
                             "missing: bigmem's side only")
    parser.add_argument("--work", help="write the datasets, the store and nnU-Net's folders here, and keep them "
                                       "(default: a temporary folder)")
    parser.add_argument("--cases", type=int, help="the first N cases of each dataset (default: all)")
    parser.add_argument("--small", action="store_true", help="halve every case's in-plane size (spacings kept)")
    parser.add_argument("--only", choices=sorted(DATASETS), action="append", help="just this dataset (repeatable)")
    args = parser.parse_args(argv)
    from rich.console import Console

    from bigmem.memory.calibration import machine_cpu_model, machine_isa_class

    console = Console(width=200)
    python = args.nnunet_python if args.nnunet_python and Path(args.nnunet_python).exists() else None
    if python is None:
        console.print(f"nnU-Net: no Python at {args.nnunet_python!r} (--nnunet-python): bigmem's side only, "
                      "nothing compared")
    report = {"machine": {"cpu": machine_cpu_model(), "isa_class": machine_isa_class(), "cpus": os.cpu_count()},
              "command": command_line(__file__), "nnunet_python": python, "axis_order": "bigmem (D, H, W) = file "
              "(x, y, z); nnU-Net's figures mapped from its plan axes", "datasets": {}}
    if python is not None:
        report["nnunet_version"] = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('nnunetv2'))"], capture_output=True,
            text=True).stdout.strip()
    failed = False
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(args.work or temporary)
        for kind in args.only or list(DATASETS):
            cases = chosen_cases(DATASETS[kind][2], args.cases, args.small)
            folder = write_dataset(work / "raw", kind, cases)
            rows, ours = bigmem_rows(folder, work / f"{kind}.h5")
            theirs = None
            if python is not None:
                nnunet, theirs = nnunet_rows(python, work, kind, rows["bigmem whole case (nonzero crop)"])
                rows.update(nnunet)
            passed = checks(rows, ours, theirs)
            failed |= not all(passed.values())
            print_table(console, kind, rows, passed)
            report["datasets"][kind] = {"cases": [{"shape_xyz": list(s), "spacing_xyz": list(p)} for s, p in cases],
                                        "bigmem_fingerprint": ours, "nnunet_fingerprint": theirs and {
                                            k: theirs[k] for k in ("spacings", "shapes_after_crop",
                                                                   "median_relative_size_after_cropping")},
                                        "rows": rows, "checks": {k: bool(v) for k, v in passed.items()}}
    write_results("topology", report, args.out, console)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
