"""``accelerate.utils.deepspeed``: the DeepSpeed names a training loop uses.

``DummyOptim``/``DummyScheduler`` stand for the DeepSpeed config's optimizer and scheduler; the wrappers are
what ``prepare`` returns for them; ``get_active_deepspeed_plugin`` answers which plugin configures the next
engine. ``HfDeepSpeedConfig`` and ``map_pytorch_optim_to_deepspeed`` are not built and raise
``NotImplementedError``.
"""

from lockstep.accelerator.engine_stepped import (
    DeepSpeedEngineWrapper,
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
)
from lockstep.backends.deepspeed.placeholders import DummyOptim, DummyScheduler
from lockstep.backends.deepspeed.plugin import get_active_deepspeed_plugin
from lockstep.utils.unsupported import HfDeepSpeedConfig, map_pytorch_optim_to_deepspeed

__all__ = [
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "DummyOptim",
    "DummyScheduler",
    "HfDeepSpeedConfig",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
]
