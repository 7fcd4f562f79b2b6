"""``bigmem compare``'s API: whole volumes in host RAM against the usual GPU recipe, on the same task.

``run`` launches and scores both paths' runs, ``render`` writes the table, compare.md and compare.png.
"""

from bigmem.compare.render import markdown, plot, rows
from bigmem.compare.run import (
    DEFAULT_PHANTOM_VOLUME, DEFAULT_TIME_BUDGET_S, DEFAULT_VAL_EVERY, GpuMemory, Settings, compare, conclude,
    largest_whole_volumes, mean_step_flops, plan_both_paths, scaled_gpu_memory, train_flops, whole_shape,
)

__all__ = ["DEFAULT_PHANTOM_VOLUME", "DEFAULT_TIME_BUDGET_S", "DEFAULT_VAL_EVERY", "GpuMemory", "Settings", "compare",
           "conclude", "largest_whole_volumes", "markdown", "mean_step_flops", "plan_both_paths", "plot", "rows",
           "scaled_gpu_memory", "train_flops", "whole_shape"]
