"""Read throughput of the store against reading the same bytes raw, and samples/s delivered.

    python benchmarks/performance/bench_pipeline.py [--cases 8] [--volume 192] [--patch 64] [--repeats 5] [--warmup 1]
        [--quick] [--out DIR]

Writes two synthetic stores (contiguous uncompressed, and 64^3-chunked) plus a raw file with the
same bytes, then times, warm and cold (pages dropped with posix_fadvise DONTNEED before each
pass): reading every case whole (store) vs np.fromfile of the raw file; patch reads; and
samples/s from VolumeLoader into a consumer that only touches each batch. Median of
``--repeats`` passes (after ``--warmup`` untimed ones, which also fill the page cache for the warm
runs) with the spread; prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, spread, time_calls, write_results

from bigmem.data.pipeline import VolumeLoader
from bigmem.data.transforms import chain
from bigmem.data.store import HDF5VolumeStore, StoreWriter
from bigmem.data.synth import make_phantom


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, path: Path, cold: bool, nbytes: int, *, repeats: int, warmup: int) -> dict:
    """Bytes per second of ``fn`` reading ``nbytes`` of ``path``: median and range over ``repeats`` passes."""
    passes = time_calls(fn, repeats=repeats, warmup=warmup, before=(lambda: drop_cache(path)) if cold else None)
    rates = spread(nbytes / t for t in passes.times_s)
    return {"bytes_per_s": rates.median, "min": rates.min, "max": rates.max}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=5, repeats_help="timed passes of each read", warmup=1,
                          warmup_help="untimed passes first (they fill the page cache for the warm runs)",
                          quick={"cases": 2, "volume": 32, "patch": 16, "repeats": 2})
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--volume", type=int, default=192)
    parser.add_argument("--patch", type=int, default=64)
    parser.add_argument("--tmp", default=None, help="folder for the test files (default: a temporary one)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    tmp = Path(tempfile.mkdtemp(prefix="bigmem-bench-", dir=args.tmp))
    shape = (args.volume,) * 3
    stores = {"contiguous": tmp / "contiguous.h5", "chunked64": tmp / "chunked.h5"}
    raw = tmp / "raw.bin"
    with StoreWriter(stores["contiguous"], num_classes=3, channel_names=["x"], chunk_edge=None) as a, \
            StoreWriter(stores["chunked64"], num_classes=3, channel_names=["x"], chunk_edge=64) as b, \
            open(raw, "wb") as raw_file:
        for index in range(args.cases):
            image, label = make_phantom(np.random.default_rng([0, index]), shape, 3)
            a.add_case(f"c{index}", image, label)
            b.add_case(f"c{index}", image, label)
            raw_file.write(image.tobytes())
            raw_file.write(label.tobytes())
        a.commit()
        b.commit()
    nbytes = raw.stat().st_size
    console.print(f"{args.cases} cases of {args.volume}^3: {nbytes / 2**20:.0f} MiB in {tmp}", style="dim")
    results = []
    passes = {"repeats": args.repeats, "warmup": args.warmup}

    def raw_read():
        np.fromfile(raw, dtype=np.uint8)

    for cold in (False, True):
        results.append({"what": "raw np.fromfile", "cold": cold, **timed(raw_read, raw, cold, nbytes, **passes)})
        for name, path in stores.items():
            store = HDF5VolumeStore(path)
            results.append({"what": f"store whole volume ({name})", "cold": cold,
                            **timed(lambda: [store.read_case(c) for c in store.case_ids], path, cold, nbytes,
                                    **passes)})
            loader_store = HDF5VolumeStore(path, check_finite=False)  # as the input pipeline reads
            results.append({"what": f"store whole volume, pipeline's read ({name})", "cold": cold,
                            **timed(lambda: [loader_store.read_case(c) for c in loader_store.case_ids], path, cold,
                                    nbytes, **passes)})
            loader_store.close()
            rng = np.random.default_rng(0)
            starts = [tuple(int(v) for v in rng.integers(0, args.volume - args.patch + 1, 3)) for _ in range(32)]
            patch_bytes = 32 * args.patch**3 * 5
            results.append({"what": f"store {args.patch}^3 patches ({name})", "cold": cold, **timed(
                lambda: [store.read_patch(store.case_ids[i % args.cases], s, (args.patch,) * 3)
                         for i, s in enumerate(starts)], path, cold, patch_bytes, **passes)})
            store.close()
    delivered = []
    for workers in (0, 2):
        for patch in (None, args.patch):
            with VolumeLoader(stores["contiguous"], shape=(args.volume,) * 3, batch_size=1, num_workers=workers,
                                   patch=patch, augment=chain("light", intensity=(0.0, 0.0))) as loader:
                stream = loader.batches()
                next(stream)
                count, started = 4 * args.cases, time.perf_counter()
                for _ in range(count):
                    images, _ = next(stream)
                    float(images[0, 0, 0, 0, 0])  # the consumer touches the batch
                elapsed = time.perf_counter() - started
            delivered.append({"workers": workers, "patch": patch, "samples_per_s": count / elapsed})
    raw_warm = next(r for r in results if r["what"] == "raw np.fromfile" and not r["cold"])["bytes_per_s"]
    raw_cold = next(r for r in results if r["what"] == "raw np.fromfile" and r["cold"])["bytes_per_s"]
    table = Table(title=f"store reads vs raw ({args.cases} x {args.volume}^3, uncompressed)")
    for column in ("read", "cache", "GB/s (median)", "spread", "vs raw"):
        table.add_column(column, justify="right")
    for r in results:
        reference = raw_cold if r["cold"] else raw_warm
        ratio = f"{100 * r['bytes_per_s'] / reference:.0f}%" if "patches" not in r["what"] else "-"
        r["vs_raw"] = r["bytes_per_s"] / reference
        table.add_row(r["what"], "cold" if r["cold"] else "warm", f"{r['bytes_per_s'] / 1e9:.2f}",
                      f"{r['min'] / 1e9:.2f}-{r['max'] / 1e9:.2f}", ratio)
    console.print(table)
    for d in delivered:
        what = f"{d['patch']}^3 patches" if d["patch"] else f"whole {args.volume}^3 volumes"
        console.print(f"delivered: {d['samples_per_s']:.1f} samples/s of {what} with {d['workers']} reader processes")
    write_results("pipeline", {"machine": socket.gethostname(), "cases": args.cases, "volume": args.volume,
                               "reads": results, "delivered": delivered}, args.out, console)
    for p in (*stores.values(), raw):
        p.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
