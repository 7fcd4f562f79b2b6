"""``bigmem compare``'s API: whole volumes in host RAM against the usual GPU recipe, on the same task.

``run`` plans, trains and scores both paths (``compare``); ``report`` holds what they found
(``CompareReport``, compare.json); ``render`` writes it for people (the table, compare.md, compare.png).
"""

from bigmem.compare.render import console_table, markdown, plot, provenance, rows
from bigmem.compare.report import CompareReport, Conclusion, PathResult, SeedRun, TrainingRun, conclude
from bigmem.compare.run import (
    DEFAULT_PHANTOM_VOLUME, DEFAULT_TIME_BUDGET_S, DEFAULT_VAL_EVERY, GpuMemory, Settings, compare,
    largest_whole_volumes, mean_step_flops, plan_both_paths, scaled_gpu_memory, train_flops, whole_shape,
)

__all__ = ["DEFAULT_PHANTOM_VOLUME", "DEFAULT_TIME_BUDGET_S", "DEFAULT_VAL_EVERY", "CompareReport", "Conclusion",
           "GpuMemory", "PathResult", "SeedRun", "Settings", "TrainingRun", "compare", "conclude", "console_table",
           "largest_whole_volumes", "markdown", "mean_step_flops", "plan_both_paths", "plot", "provenance", "rows",
           "scaled_gpu_memory", "train_flops", "whole_shape"]
