"""Accelerate's launch flags for hardware and services lockstep does not drive: accepted, then refused.

``accelerate launch`` has flags for TPUs, SageMaker, Megatron-LM, FP8 recipes, sequence parallelism
(``ParallelismConfig``'s DeepSpeed-Ulysses ``sp_*`` settings) and mpirun. ``lockstep launch`` parses each of them in both spellings (so a
command line written for Accelerate is understood), and giving one is a :class:`~lockstep.errors.UsageError`:
one line naming the flag as it was typed, saying what is missing and what to do, exit code 2.

:data:`UNSUPPORTED` is the one table of these flags.

This module must not import torch.

Example:
    >>> parser = argparse.ArgumentParser()
    >>> add_unsupported_flags(parser)
    >>> flag, flags = refused(parser.parse_args(["--tpu_use_sudo"]))[0]
    >>> print(flags.message(flag))
    --tpu_use_sudo is not supported: lockstep does not drive TPUs (torch_xla). Train on CPUs or GPUs...
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REFUSED_DEST = "unsupported_flags"
"""The namespace attribute that collects the unsupported flags given, in order."""


@dataclass(frozen=True, kw_only=True)
class UnsupportedFlags:
    """Launch flags for one thing lockstep does not drive, and what to tell whoever gives one."""

    reason: str
    """Why the flag cannot work here, e.g. ``lockstep does not drive TPUs (torch_xla).``"""
    advice: str
    """What to do instead."""
    switches: tuple[str, ...] = ()
    """Flags that take no value, as Accelerate spells them without the dashes (``tpu_use_sudo``)."""
    options: tuple[str, ...] = ()
    """Flags that take one value (``vm``)."""
    planned: bool = False
    """lockstep means to support it ("not supported yet")."""

    def message(self, flag: str) -> str:
        """The one line for ``flag`` as the user typed it."""
        return f"{flag} is not supported{' yet' if self.planned else ''}: {self.reason} {self.advice}"


_MEGATRON_OPTIONS = tuple(
    f"megatron_lm_{name}"
    for name in (
        "tp_degree use_custom_fsdp no_load_optim eod_mask_loss overlap_cpu_optimizer_d2h_h2d no_save_optim "
        "optimizer_cpu_offload use_precision_aware_optimizer decoder_last_pipeline_num_layers pp_degree "
        "num_micro_batches sequence_parallelism recompute_activations use_distributed_optimizer "
        "gradient_clipping recompute_granularity recompute_method recompute_num_layers attention_backend "
        "expert_model_parallel_size context_parallel_size attention_dropout hidden_dropout "
        "attention_softmax_in_fp32 expert_tensor_parallel_size calculate_per_token_loss "
        "use_rotary_position_embeddings"
    ).split()
)
_FP8_OPTIONS = tuple(
    f"fp8_{name}"
    for name in (
        "backend margin interval format amax_history_len amax_compute_algo override_linear_precision "
        "opt_level enable_fsdp_float8_all_gather pad_inner_dim"
    ).split()
)
_SEQUENCE_PARALLEL_OPTIONS = tuple(
    f"parallelism_config_{name}"
    for name in "sp_size sp_backend sp_seq_length sp_seq_length_is_variable sp_attn_implementation".split()
)

UNSUPPORTED: tuple[UnsupportedFlags, ...] = (
    UnsupportedFlags(
        reason="lockstep does not drive TPUs (torch_xla).",
        advice="Train on CPUs or GPUs (drop the flag), or launch TPU jobs with torch_xla's own tools.",
        switches=("tpu", "tpu_cluster", "no_tpu_cluster", "tpu_use_sudo"),
        options=("vm", "env"),
    ),
    UnsupportedFlags(
        reason="lockstep does not start Amazon SageMaker jobs.",
        advice="Run `lockstep launch` inside the job's container on machines you reach yourself.",
        options=("aws_access_key_id", "aws_secret_access_key"),
    ),
    UnsupportedFlags(
        reason="the Megatron-LM backend is not part of lockstep.",
        advice="Shard large models with --use-fsdp (FSDP2).",
        switches=("use_megatron_lm",),
        options=_MEGATRON_OPTIONS,
    ),
    UnsupportedFlags(
        reason="lockstep has no FP8 backend (TransformerEngine, MS-AMP or torchao) and no FP8 recipes.",
        advice="Use --mixed-precision bf16.",
        switches=("fp8_use_autocast_during_eval",),
        options=_FP8_OPTIONS,
        planned=True,
    ),
    UnsupportedFlags(
        reason="DeepSpeed-Ulysses sequence parallelism (ParallelismConfig's sp_* settings) is not part of "
        "lockstep.",
        advice="Split the processes with --parallelism-config-tp-size and --parallelism-config-dp-shard-size.",
        options=_SEQUENCE_PARALLEL_OPTIONS,
    ),
    UnsupportedFlags(
        reason="lockstep's FSDP2 does not offload the inputs of checkpointed layers to the CPU; its activation "
        "policies apply one at a time.",
        advice="Use --fsdp-activation-checkpointing true (recompute every layer), op (selective) or offload (all "
        "activations in CPU memory, without recomputation).",
        options=("fsdp_activation_checkpointing_offload",),
        planned=True,
    ),
    UnsupportedFlags(
        reason="lockstep launch does not start workers with mpirun.",
        advice="Run `lockstep launch --num-machines N --machine-rank R ...` on each machine, or start the "
        "script with mpirun yourself: lockstep reads the MPI environment.",
        options=("mpirun_hostfile", "mpirun_ccl"),
    ),
    UnsupportedFlags(
        reason="lockstep does not use Intel Extension for PyTorch or Intel XPUs (Accelerate 1.15 dropped "
        "these flags too).",
        advice="Drop the flag: PyTorch's own CPU kernels need no extension.",
        switches=("ipex", "use_xpu"),
    ),
)
"""Every refused launch flag, by what it configures."""
EPILOG = (
    "Accelerate's flags for TPUs, SageMaker, Megatron-LM, FP8, sequence parallelism and mpirun are "
    "accepted in both spellings and refused with one line saying what to do instead (exit code 2)."
)
"""What ``lockstep launch --help`` says about the flags of this table (each one is hidden from the list)."""


class _Refuse(argparse.Action):
    """Records that an unsupported flag was given (the command refuses it once parsing is done)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, flags: UnsupportedFlags, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.flags = flags

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = [*getattr(namespace, self.dest, []), (option_string or self.option_strings[0], self.flags)]
        setattr(namespace, self.dest, given)


def spellings(name: str) -> tuple[str, ...]:
    """A flag's spellings: dashed, then Accelerate's (``--tpu-use-sudo``, ``--tpu_use_sudo``)."""
    return tuple(dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name}")))


def add_unsupported_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`UNSUPPORTED` to ``parser``, hidden from ``--help``."""
    for flags in UNSUPPORTED:
        for names, nargs in ((flags.switches, 0), (flags.options, None)):
            for name in names:
                parser.add_argument(
                    *spellings(name),
                    action=_Refuse,
                    flags=flags,
                    nargs=nargs,
                    dest=REFUSED_DEST,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )


def refused(args: argparse.Namespace) -> list[tuple[str, UnsupportedFlags]]:
    """Every unsupported flag in ``args`` as typed, with its table row, in the order given."""
    return list(getattr(args, REFUSED_DEST, []))
