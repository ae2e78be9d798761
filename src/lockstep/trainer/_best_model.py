"""Which evaluation was the best (``metric_for_best_model``, ``greater_is_better``) and where it was saved."""

from __future__ import annotations

import math
from typing import Any

from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import TrainerState


def metric_key(args: TrainingArguments) -> str:
    """``metric_for_best_model`` with the ``eval_`` prefix the metrics carry."""
    name = str(args.metric_for_best_model)
    return name if name.startswith("eval_") else f"eval_{name}"


def metric_value(args: TrainingArguments, metrics: dict[str, Any]) -> float:
    """The value of ``metric_for_best_model`` in ``metrics``; a clear error naming those that exist."""
    key = metric_key(args)
    if key not in metrics:
        # log() adds the epoch to the evaluation's metrics (as transformers' does): not a metric to name
        shown = [k for k in metrics if k != "epoch" and not k.endswith(("_runtime", "_per_second"))]
        available = ", ".join(sorted(shown))
        raise ValueError(
            f"TrainingArguments(metric_for_best_model={args.metric_for_best_model!r}): the evaluation returned no "
            f"{key!r}. Its metrics are: {available or 'none'}. Name one of them, or return {key[5:]!r} from "
            "compute_metrics."
        )
    return float(metrics[key])


def is_better(args: TrainingArguments, value: float, best: float | None, threshold: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``threshold`` in the direction of ``greater_is_better``."""
    if best is None or math.isnan(best):
        return not math.isnan(value)
    return value - best > threshold if args.greater_is_better else best - value > threshold


def update_best(args: TrainingArguments, state: TrainerState, metrics: dict[str, Any]) -> bool:
    """Record ``metrics`` as the best so far if they are; returns whether they were."""
    if args.metric_for_best_model is None:
        return False
    value = metric_value(args, metrics)
    if not is_better(args, value, state.best_metric):
        return False
    state.best_metric = value
    state.best_global_step = state.global_step
    return True
