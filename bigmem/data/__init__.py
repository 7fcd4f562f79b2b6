"""HDF5 store format, synthetic phantoms and the input pipeline."""
