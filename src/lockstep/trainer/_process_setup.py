"""Process-wide settings a Trainer applies once: determinism, TF32, log levels, the model's KV cache and
NEFTune noise on the input embeddings; after a resize, the accumulation the Accelerator kept."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from lockstep.accelerator import Accelerator
from lockstep.rng import set_seed
from lockstep.trainer._setup_checks import enable_gradient_checkpointing
from lockstep.trainer.accelerator_factory import create_accelerator_and_postprocess
from lockstep.trainer.arguments import TrainingArguments

logger = logging.getLogger("lockstep.trainer")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS.update({"error": logging.ERROR, "critical": logging.CRITICAL})


def seed_everything(args: TrainingArguments) -> None:
    """``seed``; with ``full_determinism`` also deterministic algorithms and cuDNN/cuBLAS settings."""
    if args.full_determinism:
        # cuBLAS needs a fixed workspace to be deterministic (set before the first cuBLAS call).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    set_seed(args.seed, deterministic=args.full_determinism)


def apply_tf32(args: TrainingArguments) -> None:
    """``tf32=True/False`` switches TF32 matmuls and convolutions; None leaves torch's setting."""
    if args.tf32 is None:
        return
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    torch.backends.cudnn.allow_tf32 = bool(args.tf32)


def process_log_level(args: TrainingArguments, *, is_main: bool, is_local_main: bool) -> int | None:
    """The level of the ``lockstep`` logger on this process (None: leave it; ``passive``)."""
    first = is_local_main if args.log_on_each_node else is_main
    name = args.log_level if first else args.log_level_replica
    return _LEVELS.get(name)


def apply_log_level(args: TrainingArguments, *, is_main: bool, is_local_main: bool) -> None:
    level = process_log_level(args, is_main=is_main, is_local_main=is_local_main)
    if level is not None:
        logging.getLogger("lockstep").setLevel(level)


def apply_use_cache(model: nn.Module, args: TrainingArguments) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = args.use_cache


class NEFTune:
    """Adds uniform noise in ``[-alpha / sqrt(L * d), alpha / sqrt(L * d)]`` to the input embeddings of a
    training forward (L: sequence length, d: embedding size), as in the NEFTune paper (arXiv 2310.05914)."""

    def __init__(self, model: nn.Module, alpha: float) -> None:
        get_embeddings = getattr(model, "get_input_embeddings", None)
        embeddings = get_embeddings() if callable(get_embeddings) else None
        if not isinstance(embeddings, nn.Module):
            raise ValueError(
                f"TrainingArguments(neftune_noise_alpha={alpha}) needs the model's input embeddings, but "
                f"{type(model).__name__} has no get_input_embeddings(). Use a transformers model, or leave "
                "neftune_noise_alpha unset."
            )
        self.alpha = float(alpha)
        self.handle = embeddings.register_forward_hook(self._add_noise)

    def _add_noise(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training or output.dim() < 3:
            return output
        scale = self.alpha / (output.size(1) * output.size(2)) ** 0.5
        return output + torch.zeros_like(output).uniform_(-scale, scale)

    def remove(self) -> None:
        self.handle.remove()


def data_parallel_share(accelerator: Any) -> tuple[int, int]:
    """(this process's data-parallel replica, the number of replicas): the processes that read different
    batches. On a device mesh with tensor parallelism the processes of one replica read the same batches,
    so batch sizes and sample counts multiply by the replicas, not by the processes."""
    config = accelerator.parallelism_config
    if config is None:
        return accelerator.process_index, accelerator.num_processes
    index = accelerator.data_parallel_rank * config.dp_shard_size + accelerator.data_parallel_shard_rank
    return index, config.data_parallel_size


def sequence_shards(accelerator: Any) -> int:
    """The processes each sequence is split over (``cp_size``; 1 without context parallelism). FSDP averages
    their gradients like those of data-parallel replicas, so a loss summed over the chunks is multiplied by it."""
    config = accelerator.parallelism_config
    return config.cp_size if config is not None else 1


def follow_kept_global_batch(args: TrainingArguments, accelerator: Any) -> None:
    """After a load: take the accumulation steps the Accelerator chose to keep the global batch on another
    number of processes (``elastic_keep_global_batch``), so that the step plan, the loop's grouping of
    micro-batches and the reported batch size follow them. Nothing changes otherwise."""
    kept = accelerator.gradient_accumulation_steps
    if kept != args.gradient_accumulation_steps:
        logger.info(
            "gradient_accumulation_steps %d -> %d to keep the global batch (elastic_keep_global_batch)",
            args.gradient_accumulation_steps,
            kept,
        )
        args.gradient_accumulation_steps = kept


def set_up_process(args: TrainingArguments, model: nn.Module) -> tuple[Accelerator, NEFTune | None]:
    """Seeds, the model's own switches (cache, gradient checkpointing), the Accelerator the arguments
    describe, TF32 and log levels: everything that sets up this process for the Trainer; and NEFTune's
    embedding noise when asked for."""
    seed_everything(args)
    apply_use_cache(model, args)
    enable_gradient_checkpointing(model, args)
    accelerator = create_accelerator_and_postprocess(args, model)
    apply_tf32(args)
    apply_log_level(
        args, is_main=accelerator.is_main_process, is_local_main=accelerator.is_local_main_process
    )
    alpha = args.neftune_noise_alpha
    return accelerator, NEFTune(model, alpha) if alpha else None
