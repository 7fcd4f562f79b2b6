"""Memory footprint: estimate, measurement, calibration and planning."""

# The training steps a measurement runs (``bigmem profile --measure/--sweep/--calibrate``): the
# first traces the step and is left out of the timing, the other two give a median. Here, not in
# memory/measure.py, so that the command line formats its help without importing numpy.
MEASURED_STEPS = 3
