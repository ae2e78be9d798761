"""The Trainer and its arguments, built on the public Accelerator API only.

Example:
    >>> from lockstep.trainer import Trainer, TrainingArguments
"""

from lockstep.trainer._evaluation import EvalPrediction, PredictionOutput
from lockstep.trainer._hyperparameter_search import BestRun
from lockstep.trainer.accelerator_config import AcceleratorConfig
from lockstep.trainer.arguments import TrainingArguments
from lockstep.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from lockstep.trainer.early_stopping import EarlyStoppingCallback
from lockstep.trainer.schedules import (
    get_constant_schedule,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_hard_restarts_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup_lr_rate,
    get_inverse_sqrt_schedule,
    get_linear_schedule_with_warmup,
    get_polynomial_decay_schedule_with_warmup,
    get_reduce_on_plateau_schedule,
    get_scheduler,
    get_wsd_schedule,
)
from lockstep.trainer.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from lockstep.trainer.trainer import Trainer, TrainOutput

__all__ = [
    "AcceleratorConfig",
    "BestRun",
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "EvalPrediction",
    "PredictionOutput",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_constant_schedule",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_cosine_with_hard_restarts_schedule_with_warmup",
    "get_cosine_with_min_lr_schedule_with_warmup",
    "get_cosine_with_min_lr_schedule_with_warmup_lr_rate",
    "get_inverse_sqrt_schedule",
    "get_linear_schedule_with_warmup",
    "get_polynomial_decay_schedule_with_warmup",
    "get_reduce_on_plateau_schedule",
    "get_scheduler",
    "get_wsd_schedule",
]
