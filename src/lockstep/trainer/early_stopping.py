"""``EarlyStoppingCallback``: stop training when ``metric_for_best_model`` stops improving.

Example:
    >>> from lockstep.trainer import EarlyStoppingCallback
    >>> stopper = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=0.01)
"""

from __future__ import annotations

from typing import Any

from lockstep.trainer._best_model import is_better, metric_key, metric_value
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import TrainerCallback, TrainerControl, TrainerState


class EarlyStoppingCallback(TrainerCallback):
    """Stops training after ``early_stopping_patience`` evaluations in a row that did not beat the best
    ``metric_for_best_model`` by more than ``early_stopping_threshold``.

    Needs ``load_best_model_at_end=True`` (so a metric and matching save/eval strategies are set), as in
    transformers.

    Args:
        early_stopping_patience: evaluations without improvement before stopping (>= 1).
        early_stopping_threshold: how much the metric must improve to count as an improvement (>= 0).
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0) -> None:
        if isinstance(early_stopping_patience, bool) or not isinstance(early_stopping_patience, int):
            raise TypeError(
                f"EarlyStoppingCallback(early_stopping_patience={early_stopping_patience!r}): pass an int."
            )
        if early_stopping_patience < 1:
            raise ValueError(
                f"EarlyStoppingCallback(early_stopping_patience={early_stopping_patience}) is invalid: it must be "
                ">= 1 (the evaluations without improvement to allow)."
            )
        if not float(early_stopping_threshold) >= 0:
            raise ValueError(
                f"EarlyStoppingCallback(early_stopping_threshold={early_stopping_threshold}) is invalid: it must "
                "be >= 0."
            )
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = float(early_stopping_threshold)
        self.early_stopping_patience_counter = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        if (
            not args.load_best_model_at_end
            or args.metric_for_best_model is None
            or args.eval_strategy == "no"
        ):
            raise ValueError(
                "EarlyStoppingCallback needs TrainingArguments(load_best_model_at_end=True) with an eval_strategy "
                f"other than 'no' (got load_best_model_at_end={args.load_best_model_at_end}, eval_strategy="
                f"{args.eval_strategy!r}): it compares evaluations by metric_for_best_model."
            )

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> Any:
        metrics = kwargs.get("metrics") or {}
        if (
            metric_key(args) not in metrics
        ):  # evaluate(metric_key_prefix="test") by the user: not ours to count
            return control
        value = metric_value(args, metrics)
        # state.best_metric is still the best before this evaluation (the Trainer updates it afterwards).
        if is_better(args, value, state.best_metric, self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True
        return control

    def state(self) -> dict[str, Any]:
        """transformers' exported state (``restore_callback_states_from_checkpoint`` rebuilds from it)."""
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"early_stopping_patience_counter": self.early_stopping_patience_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.early_stopping_patience_counter = int(state["early_stopping_patience_counter"])
