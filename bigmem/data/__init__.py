"""HDF5 store format, synthetic phantoms and the input pipeline."""

# The HDF5 chunk edge stores are written with (data.store.StoreWriter, data.convert, bigmem convert
# --chunks). Whole-volume reads touch every chunk of a case; 64^3 voxels (1 MiB of float32 per
# channel) keeps the per-chunk overhead small while letting partial (patch) reads skip most of a
# case. Defined here, not in store.py, so the command line shows it without importing h5py.
DEFAULT_CHUNK_EDGE = 64
