"""Training loop, losses, schedules and checkpoints (imports TensorFlow inside functions)."""
