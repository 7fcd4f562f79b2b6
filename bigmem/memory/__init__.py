"""Memory footprint: estimate, measurement, calibration and planning."""
