"""Whole or sliding: the inference memory plan decides, before a case's volume goes through the network.

``bigmem predict --mode auto`` asks the planning API, per case, whether the whole (padded) volume's
inference footprint (``memory.plans.plan_inference`` over ``memory.estimate.estimate`` in its forward
pass: weights, input copies, the forward pass's live activations, probabilities, the source mapping)
fits the memory budget (the one rule, ``memory.budget.resolve_budget``); if not, it slides windows of
what the network trained on (``Predictor.window``).
``--mode whole`` on a volume that does not fit is refused (exit 3), as training refuses a job.
"""

from __future__ import annotations

from typing import Callable, Sequence

from rich.console import Console

from bigmem.data.pipeline import padded_shape  # the one rounding rule: predict pads as training does
from bigmem.errors import InsufficientMemoryError
from bigmem.infer.predict import Ensemble, Mode, Predictor
from bigmem.units import format_bytes


def whole_volume_plan(predictor: Predictor | Ensemble, shape: Sequence[int], budget):
    """The inference ``Plan`` of one whole case of spatial ``shape`` (padded to the size contract) in ``budget``.

    An ensemble's members run one after the other: the plan is its largest member's (by predicted peak), with
    every member's weights and the probabilities' running sum counted (``memory.estimate``'s ``ensemble``).
    """
    from bigmem.memory.plans import plan_inference
    from bigmem.memory.profile import counts_function

    members = predictor.members if isinstance(predictor, Ensemble) else (predictor,)
    plans = [plan_inference(m.config, counts_function(m.config), budget, padded_shape(shape, m.divisors), check=False,
                            ensemble=len(members)) for m in members]
    return max(plans, key=lambda plan: plan.predicted_peak_bytes)


def mode_chooser(mode: str, budget_bytes: int | None = None, *, flag: str = "--memory-budget",
                 ignore_plan: bool = False,
                 console: Console | None = None) -> Callable[[Predictor, Sequence[int]], Mode]:
    """``(predictor, spatial_shape) -> Mode`` for ``--mode``: fixed, checked (whole) or chosen (auto).

    Args:
        mode: 'auto', 'whole' or 'sliding'.
        budget_bytes: an explicit budget (``--memory-budget``), else the placement's or MemAvailable.
        flag: how the budget was spelled, for messages.
        ignore_plan: run ``whole`` even where the plan says it does not fit (``--ignore-plan``).
        console: where auto's choice and its reason are printed.

    Returns:
        The chooser ``bigmem.infer.predict.predict`` calls once per case, when its shape is known.

    Raises:
        InsufficientMemoryError: (from the chooser; exit 3) ``whole`` does not fit, unless ``ignore_plan``.
    """
    from bigmem.config.options import look_up_option
    from bigmem.memory.budget import resolve_budget

    chosen = look_up_option(mode, Mode, flag="{predict.mode}")
    if chosen is Mode.SLIDING or (chosen is Mode.WHOLE and ignore_plan):
        return lambda predictor, shape: chosen
    budget = resolve_budget(budget_bytes, flag=flag)

    def choose(predictor: Predictor | Ensemble, shape: Sequence[int]) -> Mode:
        plan = whole_volume_plan(predictor, shape, budget)
        predicted, fits = plan.predicted_peak_bytes, plan.fits
        models = f", {len(predictor.members)} models" if isinstance(predictor, Ensemble) else ""
        what = (f"whole {'x'.join(map(str, padded_shape(shape, predictor.divisors)))}{models} needs "
                f"{format_bytes(predicted)} of a {format_bytes(budget.budget_bytes)} budget ({budget.source})")
        if chosen is Mode.WHOLE:
            if not fits and not ignore_plan:
                raise InsufficientMemoryError(
                    f"Predicted peak {format_bytes(predicted)} for {predictor.config.model.name} at "
                    f"{'x'.join(map(str, padded_shape(shape, predictor.divisors)))} (inference, "
                    f"{predictor.config.train.precision.value}) exceeds the memory budget "
                    f"{format_bytes(budget.budget_bytes)} ({budget.source}): use {{predict.mode}} sliding (or auto), "
                    "or pass {predict.ignore_plan} to try anyway.", predicted, budget.budget_bytes)
            return Mode.WHOLE
        if console is not None:
            console.print(f"auto: {'whole' if fits else 'sliding'} ({what})", highlight=False)
        return Mode.WHOLE if fits else Mode.SLIDING

    return choose
