"""``accelerate.utils.megatron_lm``: importable, not supported (lockstep does not drive Megatron-LM).

Constructing any of these classes or calling the functions raises ``NotImplementedError``.
"""

from lockstep.utils.unsupported import (
    AbstractTrainStep,
    BertTrainStep,
    GPTTrainStep,
    MegatronEngine,
    MegatronLMDummyDataLoader,
    MegatronLMDummyScheduler,
    MegatronLMOptimizerWrapper,
    MegatronLMSchedulerWrapper,
    T5TrainStep,
    avg_losses_across_data_parallel_group,
    gather_across_data_parallel_groups,
    megatron_lm_initialize,
    megatron_lm_prepare_data_loader,
    megatron_lm_prepare_model_optimizer_scheduler,
    megatron_lm_prepare_optimizer,
    megatron_lm_prepare_scheduler,
)

__all__ = [
    "AbstractTrainStep",
    "BertTrainStep",
    "GPTTrainStep",
    "MegatronEngine",
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "MegatronLMOptimizerWrapper",
    "MegatronLMSchedulerWrapper",
    "T5TrainStep",
    "avg_losses_across_data_parallel_group",
    "gather_across_data_parallel_groups",
    "megatron_lm_initialize",
    "megatron_lm_prepare_data_loader",
    "megatron_lm_prepare_model_optimizer_scheduler",
    "megatron_lm_prepare_optimizer",
    "megatron_lm_prepare_scheduler",
]
