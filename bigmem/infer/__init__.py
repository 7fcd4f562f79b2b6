"""Using a trained model: whole-volume and sliding-window prediction, the source geometry, evaluation."""

# The sliding-window overlap every caller defaults to (infer.sliding, infer.predict, bigmem predict
# --overlap, compare's scoring of a patch-trained run): nnU-Net's and MLPerf's 0.5 (MONAI's default
# is 0.25). Defined here, not in sliding.py, so the command line shows it without importing numpy.
DEFAULT_OVERLAP = 0.5
