"""Learning-rate schedule: linear warmup, then polynomial decay (Goyal et al. 2017 recipe)."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="bigmem")
class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """lr(step) rises linearly to ``base_lr`` over ``warmup_steps``, then decays as
    ``end_lr + (base_lr - end_lr) * (1 - progress) ** power`` until ``total_steps``.

    ``step`` is the optimizer's iteration count (0 for the first update), so a resumed run that
    restores the optimizer continues on the same curve.
    """

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0, power: float = 2.0,
                 end_lr: float = 0.0):
        self.base_lr = float(base_lr)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(min(warmup_steps, max(total_steps - 1, 0)))
        self.power = float(power)
        self.end_lr = float(end_lr)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = float(max(self.warmup_steps, 1))
        warm = self.base_lr * (step + 1.0) / warmup
        decay_steps = float(max(self.total_steps - self.warmup_steps, 1))
        progress = ops.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        decayed = self.end_lr + (self.base_lr - self.end_lr) * ops.power(1.0 - progress, self.power)
        return ops.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return {"base_lr": self.base_lr, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "power": self.power, "end_lr": self.end_lr}
