"""Memory footprint: estimate, measurement, calibration and the search for what fits a budget."""

# The training steps a measurement runs (``bigmem profile --measure/--sweep/--calibrate``): the
# first traces the step and is left out of the timing, the other two give a median. Here, not in
# memory/measure.py, so that the command line formats its help without importing numpy.
MEASURED_STEPS = 3
