"""``bigmem convert``: NIfTI datasets (MSD, nnU-Net v2 raw, KiTS case folders, globs) -> a bigmem HDF5 store."""

from __future__ import annotations

import argparse

from bigmem.cli.common import check_output_file, check_positive, parse_shape, parse_spacing
from bigmem.data import DEFAULT_CHUNK_EDGE
from bigmem.errors import UsageError
from bigmem.units import parse_bytes

HELP = "convert NIfTI data (MSD, nnU-Net v2, KiTS folders) to an HDF5 store"

DESCRIPTION = f"""\
Convert the training cases of SRC, or of --images/--labels globs, into a bigmem store. SRC is:
  - a Medical Segmentation Decathlon folder: dataset.json lists the training image/label pairs
    (3D or 4D images);
  - an nnU-Net v2 raw folder (DatasetXXX_Name): dataset.json names the channels ("channel_names"),
    labels and "file_ending"; each case is imagesTr/CASE_0000.nii.gz, CASE_0001.nii.gz, ... (one
    file per channel, converted in channel order) with labelsTr/CASE.nii.gz. Region labels
    ("whole_tumor": [1, 2, 3] with "regions_class_order") train the label values as classes and
    are kept in the store for scoring as regions;
  - KiTS19/21/23 case folders (case_00000/imaging.nii.gz, segmentation.nii.gz): the case id is the
    folder's name; classes background, kidney, tumor (and cyst where a label holds 3); folders
    without a segmentation (test cases) are skipped and counted.
The first line says which layout was found, with its channels, classes and cases. Every case is
reoriented to nibabel's closest canonical orientation (RAS), checked (shapes, affines, finite
values, label values), and written with its source affine and shape; per-channel intensity
statistics are stored. STORE.manifest.json is written beside the store. The store is written
under a temporary name and renamed: an interrupted conversion leaves nothing behind.

--images GLOB that matches one channel file of cases that have several (CASE_0000.nii.gz beside
CASE_0001.nii.gz, ...) converts that channel only, and says so: give the dataset folder as SRC to
convert all of them.

Chunks: by default {DEFAULT_CHUNK_EDGE}^3 voxels x all channels (whole-volume reads touch few, large chunks;
patch reads skip most of a case); --chunks none writes contiguous datasets (no compression).
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("convert", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", nargs="?", metavar="SRC", help="an MSD or nnU-Net v2 folder (or its dataset.json), "
                                                              "or a folder of KiTS case folders")
    parser.add_argument("-o", "--out", required=True, metavar="STORE.h5", help="the store to write")
    parser.add_argument("--images", metavar="GLOB", help="image files, e.g. 'data/*_0000.nii.gz' (instead of SRC)")
    parser.add_argument("--labels", metavar="GLOB", help="label files, paired with --images by case id")
    parser.add_argument("--spacing", metavar="X,Y,Z", help="resample to this voxel spacing in mm (image trilinear, "
                                                           "label nearest), in the canonical (RAS) axis order")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--volume", type=int, metavar="N", help="centre-crop/pad every case to N^3")
    shape.add_argument("--shape", metavar="D,H,W", help="centre-crop/pad every case to D,H,W")
    parser.add_argument("--chunks", default=str(DEFAULT_CHUNK_EDGE), metavar="EDGE|none",
                        help=f"chunk edge in voxels (default {DEFAULT_CHUNK_EDGE}), or none for contiguous datasets")
    parser.add_argument("--compression", choices=["none", "lzf", "gzip"], default="none",
                        help="HDF5 compression (default none: fastest reads)")
    parser.add_argument("--max-write-rate", metavar="RATE", help="cap the average write rate, e.g. 200MB/s, so a "
                                                                  "conversion beside a training run does not starve it")
    parser.add_argument("--block-size", metavar="SIZE", help="hand data to HDF5 (and flush) in blocks of SIZE, "
                                                             "e.g. 1MiB (default: a whole dataset at once)")
    parser.add_argument("--normalization", default="auto",
                        choices=["auto", "ct", "zscore", "zscore_nonzero", "none"],
                        help="intensity normalisation, recorded in the store and used by every path (training, "
                             "patches, validation, predict): auto (default) chooses per channel as nnU-Net does: ct "
                             "for a channel named CT (clip to the dataset foreground's 0.5-99.5 percentiles, then "
                             "its mean and std), else a per-case z-score, within the nonzero mask where cropping to "
                             "it would remove a quarter of the median case")
    parser.add_argument("--append", action="store_true", help="add the cases to an existing store")
    parser.add_argument("--force", action="store_true", help="overwrite an existing store")
    parser.add_argument("--skip-bad", action="store_true",
                        help="skip a bad case with a warning (and count them at the end) instead of stopping")
    parser.set_defaults(run=run)


def _chunk_edge(args) -> int | None:
    """``--chunks``: the chunk edge in voxels, or None for contiguous datasets (which cannot be compressed)."""
    if args.chunks.lower() == "none":
        if args.compression != "none":
            raise UsageError("--chunks none writes contiguous datasets, which HDF5 cannot compress; "
                             "drop --compression or give a chunk edge.")
        return None
    try:
        chunk_edge = int(args.chunks)
    except ValueError:
        chunk_edge = 0
    if chunk_edge < 1:
        raise UsageError(f"Invalid --chunks {args.chunks!r}: expected a chunk edge in voxels (e.g. 64) or none.")
    return chunk_edge


def run(args) -> int:
    if args.src and (args.images or args.labels):
        raise UsageError("Give either SRC or --images/--labels, not both.")
    if not args.src and not (args.images and args.labels):
        raise UsageError("Give SRC (an MSD or nnU-Net v2 folder, its dataset.json, or KiTS case folders), or both "
                         "--images and --labels.")
    if args.append and args.force:
        raise UsageError("Give either --append or --force, not both.")
    chunk_edge = _chunk_edge(args)
    rate = parse_bytes(args.max_write_rate.removesuffix("/s"), flag="--max-write-rate") if args.max_write_rate \
        else None
    block = parse_bytes(args.block_size, flag="--block-size") if args.block_size else None
    if rate == 0 or block == 0:
        raise UsageError("--max-write-rate and --block-size must be positive.")
    check_positive("--volume", args.volume)
    shape = (args.volume,) * 3 if args.volume is not None else (parse_shape(args.shape) if args.shape else None)
    spacing = parse_spacing(args.spacing) if args.spacing else None
    check_output_file(args.out, "-o")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from bigmem import api
    from bigmem.data.layouts import describe_dataset, read_dataset, read_globs
    from bigmem.units import format_count

    dataset = read_dataset(args.src) if args.src else read_globs(args.images, args.labels)  # the count, for the bar
    console = Console(soft_wrap=True, stderr=False)
    console.print(describe_dataset(dataset), highlight=False)
    for note in dataset.notes:
        console.print(note, style="yellow", highlight=False)
    with Progress(TextColumn("[bold]convert"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeRemainingColumn(), console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=len(dataset.cases))

        def advance(case_id: str) -> None:  # called when a case is done (converted or skipped)
            progress.update(task, description=case_id, advance=1)

        report = api.convert(dataset, args.out, force=args.force, append=args.append, skip_bad=args.skip_bad,
                         compression=None if args.compression == "none" else args.compression, chunk_edge=chunk_edge,
                         shape=shape, progress=advance, warn=lambda m: console.print(m, style="yellow"),
                         max_write_rate=rate, block_bytes=block, spacing=spacing, normalization=args.normalization)
    for line in report.preprocessing:
        console.print(f"normalisation {line}", highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", style="yellow", highlight=False)
    skipped = f"; {len(report.skipped)} skipped" if report.skipped else ""
    console.print(f"Wrote {format_count(len(report.converted), 'case')} to {report.store}{skipped}; manifest "
                  f"{report.manifest}", highlight=False)
    return 0
