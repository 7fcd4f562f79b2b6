"""The data-parallel baseline: tf.distribute on real GPUs, or on N logical CPU devices."""
