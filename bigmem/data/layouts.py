"""Dataset folder layouts: which one a folder is, and its cases, for ``bigmem convert``, ``predict`` and ``evaluate``.

* Medical Segmentation Decathlon (MSD): dataset.json lists ``"training"`` ``{"image", "label"}``
  pairs (3D or 4D images), ``"modality"`` ``{"0": "FLAIR"}`` and ``"labels"`` ``{"0": "background"}``;
  test images are listed as ``"test"``, or lie in imagesTs/.
* nnU-Net v2 raw (``DatasetXXX_Name/``): dataset.json has ``"channel_names"``, ``"labels"``
  ``{"background": 0}``, ``"file_ending"`` and ``"numTraining"`` but lists no case: a case is
  ``imagesTr/CASE_0000<file_ending>``, ``CASE_0001...`` (one file per channel) with
  ``labelsTr/CASE<file_ending>``; test images are in imagesTs/. Region labels (``"whole_tumor":
  [1, 2, 3]`` with ``"regions_class_order"``) train the label files' values as classes and keep the
  regions for scoring (``nifti.read_dataset_json``).
* KiTS19/21/23 case folders: ``case_00000/imaging.nii.gz`` and ``case_00000/segmentation.nii.gz``
  (absent in a test case), no dataset.json (a kits.json beside them is not needed). The case id is
  the folder's name; one channel, CT; classes background, kidney, tumor, and cyst (3) from KiTS21.
* for ``predict`` also: one KiTS case folder, a folder of NIfTI files (a case per file, or nnU-Net's
  ``CASE_0000`` per channel), or one NIfTI file.
* for ``evaluate``'s references (``list_labels``): the label maps of any of these folders (labelsTr/ and
  labelsTs/, or each case folder's segmentation.nii.gz), or a folder of label maps, each under the
  case id ``predict`` names its output with.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path

from bigmem.config.options import StrOption
from bigmem.data.nifti import SourceCase, SourceDataset, case_id_of, read_dataset_json, region_classes
from bigmem.errors import DataError
from bigmem.units import format_count

NIFTI_SUFFIXES = (".nii.gz", ".nii")
KITS_IMAGE, KITS_LABEL = "imaging", "segmentation"  # each with a NIfTI suffix, in a case folder
KITS_CHANNELS = ["CT"]
KITS_LABELS = ["background", "kidney", "tumor", "cyst"]
KITS19_CLASSES = 3  # KiTS19 labels kidney (1) and tumor (2); KiTS21 and KiTS23 add cyst (3)
_CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})(?P<ending>\.nii(?:\.gz)?)$")  # nnU-Net's CASE_0000


class Layout(StrOption):
    """A dataset folder's layout (``detect_layout``), or a single NIfTI file."""

    MSD = "msd"
    NNUNET = "nnunet"
    KITS = "kits"  # a folder of KiTS case folders
    KITS_CASE = "kits_case"  # one KiTS case folder
    FILES = "files"  # a folder of NIfTI files
    FILE = "file"  # one NIfTI file

    @property
    def title(self) -> str:
        """How messages name the layout ("nnU-Net v2 raw")."""
        return _TITLES[self]


_TITLES = {Layout.MSD: "Medical Segmentation Decathlon", Layout.NNUNET: "nnU-Net v2 raw",
           Layout.KITS: "KiTS case folders", Layout.KITS_CASE: "KiTS case folder", Layout.FILES: "NIfTI files",
           Layout.FILE: "NIfTI file"}
_EXPECTED = ("a Medical Segmentation Decathlon or nnU-Net v2 folder (dataset.json, imagesTr/, labelsTr/), "
             "KiTS case folders (case_00000/imaging.nii.gz, segmentation.nii.gz)")


def _nifti(path: Path) -> bool:
    return path.is_file() and path.name.endswith(NIFTI_SUFFIXES) and not path.name.startswith(".")


def _kits_file(folder: Path, stem: str) -> Path | None:
    """``folder/stem.nii.gz`` (or ``.nii``) where it exists."""
    return next((folder / f"{stem}{suffix}" for suffix in NIFTI_SUFFIXES if (folder / f"{stem}{suffix}").is_file()),
                None)


def _kits_folders(folder: Path) -> list[Path]:
    """The KiTS case folders of ``folder``: itself where it holds imaging.nii.gz, else its subfolders that do."""
    if _kits_file(folder, KITS_IMAGE):
        return [folder]
    return [d for d in sorted(folder.iterdir()) if d.is_dir() and not d.name.startswith(".")
            and _kits_file(d, KITS_IMAGE)]


def _json_layout(json_path: Path) -> tuple[Layout, str]:
    """MSD or nnU-Net v2, as a dataset.json says, and why (for messages).

    MSD's lists its training cases (``training``), or at least its test images (``test``);
    nnU-Net v2's names its ``channel_names`` and lists no case.

    Raises:
        DataError: the file is neither (``read_dataset_json``'s checks, or no ``training`` list and no
            ``channel_names``), naming it.
    """
    meta = read_dataset_json(json_path)
    if meta["has_training"]:
        return Layout.MSD, f"{json_path} has a 'training' list"
    if meta["has_channel_names"]:
        return Layout.NNUNET, f"{json_path} has 'channel_names' and no 'training' list"
    if meta["test"]:
        return Layout.MSD, f"{json_path} lists 'test' images"
    raise DataError(f"{json_path} lists no training cases and has no channel_names: it is neither a Medical "
                    "Segmentation Decathlon dataset.json (a 'training' list of {\"image\": ..., \"label\": ...} "
                    "entries) nor an nnU-Net v2 one ('channel_names', with imagesTr/CASE_0000.nii.gz per channel "
                    "and labelsTr/CASE.nii.gz); add the one that describes the folder.")


def detect_layout(folder: str | Path) -> Layout | None:
    """The layout of a dataset folder.

    Args:
        folder: a folder.

    Returns:
        ``Layout.MSD`` (a dataset.json with a ``training`` list, or only ``test`` images),
        ``Layout.NNUNET`` (a dataset.json with ``channel_names`` and no ``training`` list),
        ``Layout.KITS_CASE`` (the folder holds imaging.nii.gz), ``Layout.KITS`` (its subfolders do),
        ``Layout.FILES`` (NIfTI files), or None (none of these).

    Raises:
        DataError: ``folder`` is not a folder, or its dataset.json is unreadable, not of the
            documented form (``nifti.read_dataset_json``), or neither MSD's nor nnU-Net v2's (no
            ``training`` list and no ``channel_names``).

    Example:
        >>> detect_layout("Dataset137_BraTS2021")  # Layout.NNUNET
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"Cannot read {str(folder)!r}: not a folder.")
    if (folder / "dataset.json").is_file():
        return _json_layout(folder / "dataset.json")[0]
    if _kits_file(folder, KITS_IMAGE):
        return Layout.KITS_CASE
    if _kits_folders(folder):
        return Layout.KITS
    return Layout.FILES if any(_nifti(f) for f in folder.iterdir()) else None


# ---- convert: the training cases ---------------------------------------------------------


def read_dataset(src: str | Path) -> SourceDataset:
    """The training cases of ``bigmem convert``'s SRC, whichever layout it has.

    Args:
        src: an MSD or nnU-Net v2 folder (or its dataset.json), a folder of KiTS case folders, or
            one KiTS case folder.

    Returns:
        The ``SourceDataset`` (``read_msd``, ``read_nnunet`` or ``read_kits``).

    Raises:
        DataError: ``src`` does not exist, is none of these layouts, or the layout's reader refuses it
            (where it finds no case, the message says which layout was read, and why).

    Example:
        >>> describe_dataset(read_dataset("Dataset001_BrainTumour"))  # 'nnU-Net v2 raw: 4 channels (FLAIR, ...'
    """
    src = Path(src)
    if not src.exists():
        raise DataError(f"Cannot read {str(src)!r}: no such file or folder.")
    if src.is_file() or (src / "dataset.json").is_file():
        json_path = src if src.is_file() else src / "dataset.json"
        layout, why = _json_layout(json_path)
        also = (f"; {str(src)!r} also holds KiTS case folders, read as such only where no dataset.json is beside "
                "them") if src.is_dir() and _kits_folders(src) else ""
        return (read_msd if layout is Layout.MSD else read_nnunet)(json_path, why=f"{why}{also}")
    if _kits_folders(src):
        return read_kits(src)
    found = [name for name in ("imagesTr", "labelsTr") if (src / name).is_dir()]
    if found:
        raise DataError(f"No dataset.json in {str(src)!r}, which has {' and '.join(f'{n}/' for n in found)}: a "
                        "Medical Segmentation Decathlon or nnU-Net v2 folder is read through its dataset.json "
                        "(channels, labels, and MSD's list of cases); add it, or give "
                        "{convert.images}/{convert.labels} globs.")
    raise DataError(f"No dataset.json in {str(src)!r} and no KiTS case folders: expected {_EXPECTED}, or "
                    "{convert.images}/{convert.labels} globs.")


def _dataset_json_path(src: str | Path, expected: str) -> Path:
    """SRC's dataset.json (SRC a folder, or the file itself); refused, saying what was ``expected``, if missing."""
    src = Path(src)
    json_path = src / "dataset.json" if src.is_dir() else src
    if not json_path.is_file():
        raise DataError(f"No dataset.json in {str(src)!r}: expected {expected}.")
    return json_path


def _training_json(json_path: Path) -> dict:
    """``read_dataset_json`` for training: regions become the classes their ``regions_class_order`` paints
    (class v named after the region painted v), and are refused without one (``nifti.region_classes``)."""
    meta = read_dataset_json(json_path)
    if meta["regions"]:
        meta["label_names"] = region_classes(meta["label_names"][0], meta["regions"], meta["regions_class_order"],
                                             str(json_path))
    return meta


def _regions_note(label_names: list[str], regions: dict[str, list[int]]) -> list[str]:
    if not regions:
        return []
    shown = "; ".join(f"{name}: {', '.join(map(str, values))}" for name, values in regions.items())
    return [f"Regions ({shown}) are trained as {len(label_names)} classes (the label values 0..{len(label_names) - 1} "
            "that regions_class_order paints) and scored as regions."]


def _read_as(title: str, why: str) -> str:
    """' Read as <layout> because <why>.' for a message, or '' without a why."""
    return f" Read as {title} because {why}." if why else ""


def read_msd(src: str | Path, *, why: str = "") -> SourceDataset:
    """The training cases listed by an MSD folder's dataset.json (or that file itself).

    Args:
        src: the folder holding dataset.json, imagesTr/ and labelsTr/, or dataset.json itself.
        why: why the folder is read as MSD (``read_dataset``'s reason), added to the message when it
            lists no case (default "": nothing added).

    Returns:
        A ``SourceDataset`` with declared channel and label names; a case id listed twice is
        kept once and reported in ``problems``.

    Raises:
        DataError: no dataset.json, or one ``read_dataset_json`` refuses (unreadable, not a JSON
            object, channels, labels or training entries not of the documented form, labels that
            are not 0..K-1), or no training cases.

    Example:
        >>> dataset = read_msd("Task01_BrainTumour")
        >>> dataset.channel_names, len(dataset.cases)  # (['FLAIR', 'T1w', 't1gd', 'T2w'], 484)
    """
    json_path = _dataset_json_path(src, "a Medical Segmentation Decathlon folder (dataset.json, imagesTr/, "
                                        "labelsTr/) or {convert.images}/{convert.labels} globs")
    meta = _training_json(json_path)
    root = json_path.parent
    cases, seen, problems = [], set(), []
    for image_name, label_name in meta["training"]:
        image, label = root / image_name, root / label_name
        case_id = case_id_of(image)
        if case_id in seen:
            problems.append(f"Case {case_id!r}: listed twice in {json_path}.")
            continue
        seen.add(case_id)
        cases.append(SourceCase(case_id, image, label))
    if not cases and not problems:
        raise DataError(f"{json_path} lists no training cases.{_read_as(Layout.MSD.title, why)}")
    return SourceDataset(cases, meta["channel_names"], meta["label_names"], str(json_path), True, problems,
                         layout=Layout.MSD, regions=meta["regions"],
                         notes=_regions_note(meta["label_names"], meta["regions"]))


def _nnunet_images(folder: Path, ending: str, channel_names: list[str], json_path: Path
                   ) -> tuple[dict[str, list[Path]], list[str], int]:
    """Case id -> its channel files (``CASE_0000<ending>``, ...) in ``folder``, one problem per bad case or
    file, and how many case ids the files name.

    A case without a file for every channel of ``channel_names``, or with a channel past them, is
    a problem (and left out); so is a file with the ending but no channel suffix, whose message
    says why the folder is read as nnU-Net v2 (``json_path``, its dataset.json, lists no case).
    """
    pattern = re.compile(rf"^(?P<case>.+)_(?P<channel>\d{{4}}){re.escape(ending)}$")
    found: dict[str, dict[int, Path]] = {}
    problems = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.startswith(".") or not path.name.endswith(ending):
            continue
        match = pattern.match(path.name)
        if match is None:
            problems.append(f"{path}: no channel suffix; nnU-Net v2 names image files CASE_0000{ending} "
                            f"(channel 0), CASE_0001{ending}, ... (read as nnU-Net v2 because {json_path} has "
                            "'channel_names' and no 'training' list of MSD cases).")
            continue
        found.setdefault(match["case"], {})[int(match["channel"])] = path
    count = len(channel_names)
    declared = f"dataset.json names {format_count(count, 'channel')} ({', '.join(channel_names)})"
    cases = {}
    for case_id, files in sorted(found.items()):
        missing = [i for i in range(count) if i not in files]
        extra = [i for i in sorted(files) if i >= count]
        if missing:
            problems.append(f"Case {case_id!r}: no file for channel {missing[0]} ({channel_names[missing[0]]}): "
                            f"{folder / f'{case_id}_{missing[0]:04d}{ending}'} is missing; {declared}.")
        elif extra:
            problems.append(f"Case {case_id!r}: {files[extra[0]]} is channel {extra[0]}, but {declared}.")
        else:
            cases[case_id] = [files[i] for i in range(count)]
    return cases, problems, len(found)


def read_nnunet(src: str | Path, *, why: str = "") -> SourceDataset:
    """The training cases of an nnU-Net v2 raw folder: imagesTr/ channel files grouped by case, labelsTr/ labels.

    Args:
        src: the ``DatasetXXX_Name`` folder, or its dataset.json.
        why: why the folder is read as nnU-Net v2 (``read_dataset``'s reason), added to the message
            when it holds no training image (default "": nothing added).

    Returns:
        A ``SourceDataset`` whose cases list every channel file in channel order; a case missing a
        channel or its label is reported in ``problems``; region labels come with their regions
        and a note; a ``numTraining`` that differs from the cases found is noted.

    Raises:
        DataError: no dataset.json, one ``read_dataset_json`` refuses (regions without
            ``regions_class_order`` among them), or no training images in imagesTr/.

    Example:
        >>> dataset = read_nnunet("Dataset001_BrainTumour")
        >>> dataset.cases[0].image_files  # [.../BRATS_001_0000.nii.gz, ..., .../BRATS_001_0003.nii.gz]
    """
    json_path = _dataset_json_path(src, "an nnU-Net v2 raw folder (dataset.json, imagesTr/, labelsTr/)")
    meta = _training_json(json_path)
    root, ending = json_path.parent, meta["file_ending"]
    images, problems, found = _nnunet_images(root / "imagesTr", ending, meta["channel_names"], json_path)
    cases = []
    for case_id, files in images.items():
        label = root / "labelsTr" / f"{case_id}{ending}"
        if not label.is_file():
            problems.append(f"Case {case_id!r}: no label {label} (nnU-Net v2 keeps labelsTr/CASE{ending} for "
                            f"imagesTr/CASE_0000{ending}).")
            continue
        cases.append(SourceCase(case_id, files, label))
    if not cases and not problems:
        raise DataError(f"{json_path} has no 'training' list (MSD) and {root / 'imagesTr'} no nnU-Net v2 training "
                        f"images: expected imagesTr/CASE_0000{ending} (one file per channel) and "
                        f"labelsTr/CASE{ending}.{_read_as(Layout.NNUNET.title, why)}")
    notes = _regions_note(meta["label_names"], meta["regions"])
    if meta["num_training"] is not None and meta["num_training"] != found:
        notes.append(f"{json_path} says numTraining {meta['num_training']}; {root / 'imagesTr'} holds "
                     f"{format_count(found, 'case')}.")
    return SourceDataset(cases, meta["channel_names"], meta["label_names"], str(json_path), True, problems,
                         layout=Layout.NNUNET, regions=meta["regions"], notes=notes)


def _listed(names: list[str], most: int = 5) -> str:
    """'a, b, c' or 'a, b, c, d, e and 3 more'."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def read_kits(src: str | Path) -> SourceDataset:
    """The training cases of KiTS case folders: ``case_XXXXX/imaging.nii.gz`` with ``segmentation.nii.gz``.

    Args:
        src: a folder of case folders, or one case folder.

    Returns:
        A ``SourceDataset``: case ids are the folders' names, one channel (CT), classes background,
        kidney and tumor, and cyst where a label holds 3 (``min_classes`` 3). Case folders without
        a segmentation (test cases) are left out, with one note that counts them.

    Raises:
        DataError: no case folder, or none with a segmentation.

    Example:
        >>> dataset = read_kits("kits19/data")
        >>> dataset.cases[0].case_id, dataset.notes  # ('case_00000', ['Skipped 90 test cases ...'])
    """
    src = Path(src)
    folders = _kits_folders(src) if src.is_dir() else []
    if not folders:
        raise DataError(f"No KiTS case folders in {str(src)!r}: expected case_00000/imaging.nii.gz and "
                        "case_00000/segmentation.nii.gz.")
    cases, tests = [], []
    for folder in folders:
        label = _kits_file(folder, KITS_LABEL)
        if label is None:
            tests.append(folder.name)
        else:
            cases.append(SourceCase(folder.name, _kits_file(folder, KITS_IMAGE), label))
    if not cases:
        raise DataError(f"No KiTS training cases in {str(src)!r}: none of its "
                        f"{format_count(len(folders), 'case folder')} has a segmentation.nii.gz (test cases are "
                        "segmented with 'bigmem predict').")
    notes = [f"Skipped {format_count(len(tests), 'test case')} (case folders without segmentation.nii.gz): "
             f"{_listed(tests)}."] if tests else []
    layout = Layout.KITS_CASE if folders == [src] else Layout.KITS
    return SourceDataset(cases, KITS_CHANNELS, KITS_LABELS, str(src), True, [], layout=layout, notes=notes,
                         min_classes=KITS19_CLASSES, channels_from="KiTS (CT) has", labels_from="KiTS's labels")


def _channel_siblings(image: Path) -> int:
    """How many channel files ``CASE_0000``, ``CASE_0001``, ... lie beside ``image`` (0 without a channel suffix)."""
    match = _CHANNEL_FILE.match(image.name)
    if match is None:
        return 0
    count = 0
    while (image.parent / f"{match['case']}_{count:04d}{match['ending']}").is_file():
        count += 1
    return count


def read_globs(images: str, labels: str) -> SourceDataset:
    """Cases from two globs, paired by case id (the file name without .nii[.gz] and _0000).

    Args:
        images: a glob of image files, e.g. ``"imagesTr/*.nii.gz"``.
        labels: a glob of label files.

    Returns:
        A ``SourceDataset`` whose classes come from the data (``declared_labels=False``); an
        image without a label, or a case id matched twice, is reported in ``problems``. Where
        ``images`` matches one channel file of cases that have more beside it (nnU-Net's
        CASE_0000 with CASE_0001, ...), a note says so and how to convert every channel.

    Raises:
        DataError: ``images`` matches no file.
    """
    image_paths = sorted(Path(p) for p in glob.glob(images))
    label_paths = {case_id_of(Path(p)): Path(p) for p in glob.glob(labels)}
    if not image_paths:
        raise DataError(f"{{convert.images}} {images!r} matches no file.")
    cases, seen, problems, partial = [], set(), [], {}
    for image in image_paths:
        case_id = case_id_of(image)
        if case_id in seen:
            problems.append(f"Case {case_id!r}: two images match --images ({image}).")
            continue
        seen.add(case_id)
        if case_id not in label_paths:
            problems.append(f"Case {case_id!r}: no label matches --labels {labels!r} for {image}.")
            continue
        cases.append(SourceCase(case_id, image, label_paths[case_id]))
        siblings = _channel_siblings(image)
        if siblings > 1:
            partial[image] = siblings
    notes = []
    if partial:
        image, count = max(partial.items(), key=lambda item: item[1])
        match = _CHANNEL_FILE.match(image.name)
        last = f"{match['case']}_{count - 1:04d}{match['ending']}"
        folder = image.parent.parent
        where = f" {str(folder)!r}" if (folder / "dataset.json").is_file() else " (with its dataset.json)"
        notes.append(f"--images {images!r} matches one channel file of {format_count(len(partial), 'case')} with "
                     f"{count} channel files beside it (e.g. {image.name} of {image.name} .. {last}): only that "
                     f"channel is converted. To convert all {count} channels, give the dataset folder{where} as SRC.")
    return SourceDataset(cases, ["image"], [], f"--images {images} --labels {labels}", False, problems, notes=notes)


def describe_dataset(dataset: SourceDataset) -> str:
    """One line: the layout, channels, classes and training cases convert found.

    Args:
        dataset: what ``read_dataset`` or ``read_globs`` listed.

    Returns:
        E.g. ``"nnU-Net v2 raw: 4 channels (FLAIR, T1w, T1gd, T2w), 4 classes (background, edema,
        non-enhancing, enhancing), 12 training cases"``.
    """
    cases = format_count(len(dataset.cases), "training case")
    if not dataset.declared_labels:
        return f"--images/--labels: {cases}; channels and classes from the data"
    names = dataset.label_names
    shown, more = names[:dataset.min_classes or len(names)], names[dataset.min_classes or len(names):]
    also = f"; {', '.join(more)} too where a label holds {', '.join(map(str, range(len(shown), len(names))))}"
    classes = f"{format_count(len(shown), 'class', 'classes')} ({', '.join(shown)}{also if more else ''})"
    channels = f"{format_count(len(dataset.channel_names), 'channel')} ({', '.join(dataset.channel_names)})"
    title = Layout(dataset.layout).title if dataset.layout else dataset.origin
    return f"{title}: {channels}, {classes}, {cases}"


# ---- predict: the images to segment ------------------------------------------------------


@dataclass(frozen=True)
class ImageListing:
    """The images of ``bigmem predict``'s INPUT, grouped by case.

    Args:
        layout: what INPUT is.
        where: the folder the images were found in (an MSD or nnU-Net v2 folder's imagesTs/), or the file.
        cases: case id -> its image files (one 3D/4D file, or one file per channel in channel
            order), sorted by id; each case's prediction is written as ``<case id>.nii.gz``.

    Example:
        >>> listing = list_images("kits23/dataset")
        >>> listing.summary, list(listing.cases)[:2]  # ('KiTS case folders: 489 cases in ...', ['case_00000', ...])
    """

    layout: Layout
    where: Path
    cases: dict[str, list[Path]]

    @property
    def summary(self) -> str:
        """One line: what was found, e.g. "KiTS case folders: 3 cases in kits/"."""
        counts = sorted({len(files) for files in self.cases.values()})
        channels = f" of {format_count(counts[0], 'channel file')}" if counts[-1] > 1 and len(counts) == 1 else ""
        return f"{self.layout.title}: {format_count(len(self.cases), 'case')}{channels} in {self.where}"


def _image_case_id(path: Path) -> str:
    """A NIfTI file's case id; a KiTS file (imaging.nii.gz) takes its case folder's name."""
    case_id = case_id_of(path)
    return (path.absolute().parent.name or case_id) if case_id in (KITS_IMAGE, KITS_LABEL) else case_id


def _clash(case_id: str, first: Path, second: Path):
    raise DataError(f"Case {case_id!r}: {first} and {second} would both be segmented into {case_id}.nii.gz; rename "
                    "one of them, or predict them into different folders.")


def _group_images(files: list[Path], where: Path) -> dict[str, list[Path]]:
    """Case id -> files: one file per case, or nnU-Net's ``CASE_0000``, ``CASE_0001``, ... per channel.

    Raises ``DataError`` where two files would take one output name (``a.nii`` and ``a.nii.gz``;
    ``a.nii.gz`` and ``a_0000.nii.gz``), or a case's channel files leave one out.
    """
    single: dict[str, Path] = {}
    channels: dict[str, dict[int, Path]] = {}
    for path in sorted(set(files)):
        match = _CHANNEL_FILE.match(path.name)
        if match is None:
            case_id = _image_case_id(path)
            if case_id in single:
                _clash(case_id, single[case_id], path)
            single[case_id] = path
            continue
        case_id, index = match["case"], int(match["channel"])
        if index in channels.setdefault(case_id, {}):
            _clash(case_id, channels[case_id][index], path)
        channels[case_id][index] = path
    for case_id in sorted(single.keys() & channels.keys()):
        _clash(case_id, single[case_id], min(channels[case_id].items())[1])
    cases = {case_id: [path] for case_id, path in single.items()}
    for case_id, found in channels.items():
        missing = [i for i in range(max(found) + 1) if i not in found]
        if missing:
            names = ", ".join(found[i].name for i in sorted(found))
            raise DataError(f"Case {case_id!r}: channel files {names} in {where} but no "
                            f"{case_id}_{missing[0]:04d} file: nnU-Net names the channel files of a case CASE_0000, "
                            "CASE_0001, ... with none left out; rename the files if each is a case of its own.")
        cases[case_id] = [found[i] for i in sorted(found)]
    return dict(sorted(cases.items()))


def _test_folder(root: Path) -> Path:
    """imagesTs/ where it holds files, else imagesTr/."""
    tests = root / "imagesTs"
    return tests if tests.is_dir() and any(_nifti(f) for f in tests.iterdir()) else root / "imagesTr"


def list_images(source: str | Path) -> ImageListing:
    """The cases ``bigmem predict`` segments in INPUT, each with its image files and its case id.

    An MSD folder gives its dataset.json's ``test`` images, else imagesTs/, else imagesTr/; an
    nnU-Net v2 folder its imagesTs/ (else imagesTr/) channel files, grouped by case; KiTS case
    folders their imaging.nii.gz, named after the folder (segmented or not); a folder of NIfTI
    files one case per file, or per nnU-Net channel group; a file, itself (a KiTS imaging.nii.gz
    named after its folder).

    Args:
        source: a NIfTI file or a folder.

    Returns:
        The ``ImageListing``; its case ids are unique, and so are the outputs named after them.

    Raises:
        DataError: no NIfTI image there; two files that would be written to one output name; a
            case missing a channel file; a dataset.json ``read_dataset_json`` refuses, or one
            whose listed test image does not exist.

    Example:
        >>> list_images("Task01_BrainTumour").cases["BRATS_485"]  # [PosixPath('Task01_BrainTumour/imagesTs/...')]
    """
    path = Path(source)
    if path.is_file():
        if not path.name.endswith(NIFTI_SUFFIXES):
            raise DataError(f"{str(path)!r} is not a NIfTI file (.nii, .nii.gz).")
        return ImageListing(Layout.FILE, path, {_image_case_id(path): [path]})
    layout = detect_layout(path)
    if layout is None:
        raise DataError(f"No NIfTI files (.nii, .nii.gz) in {str(path)!r}: expected NIfTI files, or {_EXPECTED}.")
    if layout in (Layout.KITS, Layout.KITS_CASE):
        return ImageListing(layout, path, {d.name or d.resolve().name: [_kits_file(d, KITS_IMAGE)]
                                           for d in _kits_folders(path)})
    if layout is Layout.FILES:
        return ImageListing(layout, path, _group_images([f for f in path.iterdir() if _nifti(f)], path))
    meta = read_dataset_json(path / "dataset.json")
    if layout is Layout.NNUNET:
        where = _test_folder(path)
        cases, problems, _ = _nnunet_images(where, meta["file_ending"], meta["channel_names"], path / "dataset.json")
        if problems:
            raise DataError(problems[0])
    elif meta["test"]:
        where, files = path, [path / name for name in meta["test"]]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise DataError(f"{path / 'dataset.json'} lists test image {missing[0]}, which does not exist.")
        cases = _group_images(files, path)
    else:
        where = _test_folder(path)
        cases = _group_images([f for f in where.iterdir() if _nifti(f)] if where.is_dir() else [], where)
    if not cases:
        raise DataError(f"No NIfTI images to segment in {str(where)!r} ({layout.title} folder {str(path)!r})."
                        f"{_read_as(layout.title, _json_layout(path / 'dataset.json')[1])}")
    return ImageListing(layout, where, cases)


# ---- evaluate: the reference label maps --------------------------------------------------


def label_case_id(path: Path) -> str:
    """The case id of a label map file: its name without ``.nii.gz``/``.nii``.

    Unlike :func:`bigmem.data.nifti.case_id_of` (for image files), a trailing ``_0000`` is kept: label
    maps carry no channel suffix (nnU-Net's ``labelsTr/CASE.nii.gz``), and ``patient_0001.nii.gz`` is
    case ``patient_0001``, as the store names the case of ``patient_0001_0000.nii.gz``.

    Example:
        >>> label_case_id(Path("labelsTr/patient_0001.nii.gz"))
        'patient_0001'
    """
    return path.name.removesuffix(".gz").removesuffix(".nii")


def _add_label(cases: dict[str, Path], case_id: str, path: Path) -> None:
    if case_id in cases:
        raise DataError(f"Case {case_id!r}: two label maps, {cases[case_id]} and {path}; expected one per case.")
    cases[case_id] = path


def label_maps(folder: Path, name: str | None = None) -> dict[str, Path]:
    """Case id -> file for the label maps (``.nii``/``.nii.gz``) directly in ``folder``, sorted by id.

    Args:
        folder: a folder of ``<case id>.nii.gz`` files (``bigmem predict``'s output, or references).
        name: how messages name the folder (default: its path, quoted), e.g. ``"PRED 'preds'"``.

    Returns:
        The case ids (``label_case_id``) and their files; ``{}`` for a folder without any.

    Raises:
        DataError: two files of one case id (``a.nii`` and ``a.nii.gz``).
    """
    name = name or repr(str(folder))
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if not _nifti(path):
            continue
        case_id = label_case_id(path)
        if case_id in files:
            raise DataError(f"Case {case_id!r}: two files in {name} ({files[case_id].name}, {path.name}); expected "
                            "one label map per case.")
        files[case_id] = path
    return files


@dataclass(frozen=True)
class LabelListing:
    """The reference label maps of ``bigmem evaluate``'s REF, by case id.

    Args:
        layout: what REF is (``detect_layout``).
        where: the folders the label maps were found in (an MSD or nnU-Net v2 folder's labelsTr/ and labelsTs/).
        cases: case id -> its label map, sorted by id; the id is the one ``bigmem predict`` gives the
            case's prediction (``<case id>.nii.gz``) when it segments the same folder.
        dataset_json: the dataset.json naming the classes (and regions): the folder's own (MSD, nnU-Net
            v2), the one beside a folder of label maps (such as labelsTr/), or None.
        label_names: names by label value where the layout fixes them (KiTS's), else empty.

    Example:
        >>> listing = list_labels("kits23/dataset")
        >>> listing.layout, list(listing.cases)[:2]  # (<Layout.KITS: 'kits'>, ['case_00000', 'case_00001'])
    """

    layout: Layout
    where: tuple[Path, ...]
    cases: dict[str, Path]
    dataset_json: Path | None = None
    label_names: tuple[str, ...] = ()


def _dataset_labels(path: Path, layout: Layout) -> tuple[tuple[Path, ...], dict[str, Path]]:
    """The label folders and label maps of an MSD or nnU-Net v2 folder: labelsTr/, and labelsTs/ where present.

    nnU-Net v2's label maps are ``CASE<file_ending>`` (the case id ``predict`` gives the channel files
    ``CASE_0000<file_ending>``, ...); MSD's are the ``training`` list's labels, each under its image's
    case id, and the labelsTs/ files, each named as its image in imagesTs/.
    """
    json_path = path / "dataset.json"
    meta = read_dataset_json(json_path)
    folders = tuple(folder for folder in (path / "labelsTr", path / "labelsTs") if folder.is_dir())
    cases: dict[str, Path] = {}
    if layout is Layout.NNUNET:
        ending = meta["file_ending"]
        for folder in folders:
            for label in sorted(folder.iterdir()):
                if _nifti(label) and label.name.endswith(ending):
                    _add_label(cases, label.name.removesuffix(ending), label)
        return folders, cases
    for image_name, label_name in meta["training"]:
        label = path / label_name
        if not label.is_file():
            raise DataError(f"{json_path} lists label {label} (for image {path / image_name}), which does not exist.")
        _add_label(cases, _image_case_id(path / image_name), label)
    if (path / "labelsTs").is_dir():
        for label in sorted((path / "labelsTs").iterdir()):
            if _nifti(label):
                _add_label(cases, _image_case_id(label), label)
    return folders, cases


def list_labels(source: str | Path) -> LabelListing:
    """The reference label maps ``bigmem evaluate`` scores against in REF, each under its case id.

    An MSD or nnU-Net v2 folder gives its labelsTr/ and, where present, labelsTs/ label maps; KiTS
    case folders each their segmentation.nii.gz, named after the folder (test cases, without one,
    are left out); a folder of NIfTI files, each file a label map named ``<case id>.nii.gz``. The
    case ids are those ``bigmem predict`` writes its outputs as (``list_images``).

    Args:
        source: a folder.

    Returns:
        The ``LabelListing``.

    Raises:
        DataError: not a folder; no label map there; two label maps of one case; a dataset.json
            ``read_dataset_json`` refuses, or whose ``training`` list names a label that does not exist.

    Example:
        >>> list(list_labels("Dataset001_BrainTumour").cases)[:2]  # ['BRATS_001', 'BRATS_002']
    """
    path = Path(source)
    layout = detect_layout(path)
    if layout is None:
        raise DataError(f"No NIfTI label maps (.nii, .nii.gz) in {str(path)!r}: expected label maps named "
                        f"<case id>.nii.gz, or {_EXPECTED}.")
    if layout in (Layout.KITS, Layout.KITS_CASE):
        folders = _kits_folders(path)
        cases = {d.name or d.resolve().name: _kits_file(d, KITS_LABEL) for d in folders if _kits_file(d, KITS_LABEL)}
        if not cases:
            raise DataError(f"No KiTS segmentation in {str(path)!r}: none of its "
                            f"{format_count(len(folders), 'case folder')} has a segmentation.nii.gz (test cases have "
                            "none, and cannot be scored).")
        return LabelListing(layout, (path,), cases, label_names=tuple(KITS_LABELS))
    if layout is Layout.FILES:
        beside = path.absolute().parent / "dataset.json"
        return LabelListing(layout, (path,), label_maps(path), beside if beside.is_file() else None)
    folders, cases = _dataset_labels(path, layout)
    if not cases:
        raise DataError(f"No label maps in {str(path)!r} ({layout.title} folder): expected labelsTr/ (and labelsTs/) "
                        f"label maps, one per case.{_read_as(layout.title, _json_layout(path / 'dataset.json')[1])}")
    return LabelListing(layout, folders, dict(sorted(cases.items())), path / "dataset.json")
