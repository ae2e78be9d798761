"""The Trainer and its arguments, built on the public Accelerator API only.

Example:
    >>> from lockstep.trainer import Trainer, TrainingArguments
"""

from lockstep.trainer._evaluation import EvalPrediction, PredictionOutput
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from lockstep.trainer.schedules import (
    get_constant_schedule,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_scheduler,
)
from lockstep.trainer.trainer import Trainer, TrainOutput

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_constant_schedule",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_linear_schedule_with_warmup",
    "get_scheduler",
]
