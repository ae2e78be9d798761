"""``TrainingArguments``: every setting of a Trainer run, with transformers' names, defaults and meanings.

Example:
    >>> args = TrainingArguments(output_dir="runs/a", learning_rate=3e-5, num_train_epochs=1)
    >>> args.eval_strategy
    'no'

From the command line (``lockstep launch train.py --learning_rate 3e-5``)::

    args = TrainingArguments.from_cli()
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep.trainer import _values
from lockstep.trainer.fsdp_options import normalize_fsdp_config, parse_fsdp_options

LR_SCHEDULER_TYPES = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES = ("no", "steps", "epoch")
DDP_BACKENDS = ("nccl", "gloo", "xccl", "hccl", "cncl")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
TRACKERS = ("jsonl", "csv", "tensorboard", "wandb", "mlflow", "all")
ACCELERATOR_CONFIG_DEFAULTS: dict[str, Any] = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
}


def _help(default: Any, text: str) -> Any:
    """A field with an immutable default and its ``--help`` text."""
    return field(default=default, metadata={"help": text})


@dataclass(kw_only=True)
class TrainingArguments:
    """Settings of a :class:`~lockstep.Trainer` run (transformers' ``TrainingArguments`` names).

    Each field's help text is also its ``--help`` line in :meth:`from_cli`.
    """

    output_dir: str = _help(
        "trainer_output", "Folder for checkpoints (checkpoint-<step>) and the final model."
    )
    logging_dir: str | None = _help(None, "Folder for tracker files (report_to); default: output_dir.")
    run_name: str | None = _help(None, "Name of the run for the trackers; default: 'trainer'.")
    num_train_epochs: float = _help(3.0, "Epochs to train (fractions allowed); ignored when max_steps > 0.")
    max_steps: int = _help(-1, "Total optimizer steps; -1 trains num_train_epochs epochs instead.")
    per_device_train_batch_size: int = _help(8, "Training batch size of each process.")
    per_device_eval_batch_size: int = _help(8, "Evaluation batch size of each process.")
    gradient_accumulation_steps: int = _help(
        1, "Micro-batches per optimizer step (the Trainer accumulates; do not also set it on the launcher)."
    )
    learning_rate: float = _help(5e-5, "Peak learning rate of AdamW.")
    weight_decay: float = _help(0.0, "AdamW weight decay (never applied to biases and normalization layers).")
    adam_beta1: float = _help(0.9, "AdamW beta1.")
    adam_beta2: float = _help(0.999, "AdamW beta2.")
    adam_epsilon: float = _help(1e-8, "AdamW epsilon.")
    optim: str = _help("adamw_torch", f"Optimizer: {', '.join(OPTIMIZERS)}.")
    lr_scheduler_type: str = _help("linear", f"Learning-rate schedule: {', '.join(LR_SCHEDULER_TYPES)}.")
    warmup_steps: int = _help(0, "Linear warm-up steps; overrides warmup_ratio when > 0.")
    warmup_ratio: float = _help(0.0, "Warm-up as a fraction of the total steps.")
    max_grad_norm: float = _help(1.0, "Clip the gradient norm to this value (0 disables clipping).")
    logging_strategy: str = _help("steps", "When to log the training loss: no, steps, epoch.")
    logging_steps: float = _help(500, "Log every N optimizer steps (a value < 1 is a fraction of the total).")
    logging_first_step: bool = _help(False, "Also log after the first optimizer step.")
    eval_strategy: str = _help("no", "When to evaluate during training: no, steps, epoch.")
    eval_steps: float | None = _help(
        None, "Evaluate every N steps (default: logging_steps); < 1: a fraction."
    )
    save_strategy: str = _help("steps", "When to save a checkpoint: no, steps, epoch.")
    save_steps: float = _help(500, "Save every N steps (a value < 1 is a fraction of the total).")
    save_total_limit: int | None = _help(None, "Keep at most this many checkpoints (oldest removed first).")
    seed: int = _help(42, "Seed of Python, NumPy and torch, set when the Trainer is created.")
    data_seed: int | None = _help(None, "Seed of the data order (default: seed).")
    bf16: bool = _help(False, "Train with bfloat16 autocast.")
    fp16: bool = _help(False, "Train with float16 autocast and loss scaling.")
    use_cpu: bool = _help(False, "Train on the CPU even when a GPU is present.")
    gradient_checkpointing: bool = _help(False, "Recompute activations in backward (transformers models).")
    gradient_checkpointing_kwargs: dict | None = field(
        default=None,
        metadata={"help": "Arguments of model.gradient_checkpointing_enable (default: use_reentrant=False)."},
    )
    torch_compile: bool = _help(False, "Compile the model with torch.compile.")
    torch_compile_backend: str | None = _help(
        None, "torch.compile backend (default inductor); implies torch_compile."
    )
    torch_compile_mode: str | None = _help(None, "torch.compile mode; implies torch_compile.")
    dataloader_pin_memory: bool = _help(True, "Pin host memory of batches (faster copies to a GPU).")
    dataloader_num_workers: int = _help(0, "Worker processes loading data (0: in the training process).")
    dataloader_drop_last: bool = _help(False, "Drop the last incomplete training batch.")
    dataloader_persistent_workers: bool = _help(False, "Keep data workers alive between epochs.")
    dataloader_prefetch_factor: int | None = _help(None, "Batches each worker loads ahead (needs workers).")
    remove_unused_columns: bool = _help(True, "Drop example keys that the model's forward does not accept.")
    label_names: list[str] | None = field(
        default=None, metadata={"help": "Batch keys holding the labels (default: the model's, or 'labels')."}
    )
    accelerator_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Dict, JSON text or JSON file: split_batches, dispatch_batches, even_batches, use_seedable_sampler, "
            "non_blocking."
        },
    )
    fsdp: str | list[str] = field(
        default="",
        metadata={
            "help": "FSDP options: full_shard or shard_grad_op, plus offload and/or auto_wrap (e.g. 'full_shard auto_wrap')."
        },
    )
    fsdp_config: dict | str | None = field(
        default=None, metadata={"help": "FSDP settings: dict, JSON text or JSON file."}
    )
    deepspeed: dict | str | None = field(
        default=None, metadata={"help": "DeepSpeed config: dict, JSON text or JSON file (not built yet)."}
    )
    ddp_backend: str | None = _help(None, f"Process-group backend: {', '.join(DDP_BACKENDS)}.")
    ddp_find_unused_parameters: bool | None = _help(
        None, "DDP find_unused_parameters (default: not gradient_checkpointing for transformers models)."
    )
    ddp_bucket_cap_mb: int | None = _help(None, "DDP gradient bucket size in MiB.")
    ddp_broadcast_buffers: bool | None = _help(None, "DDP broadcast_buffers (default True).")
    ddp_timeout: int = _help(1800, "Seconds a collective may wait before the run fails.")
    report_to: str | list[str] | None = field(
        default="none",
        metadata={"help": "Trackers: jsonl, csv, tensorboard, all or none (a list or comma-separated)."},
    )
    disable_tqdm: bool | None = _help(None, "Hide the progress bar (also LOCKSTEP_DISABLE_PROGRESS_BARS=1).")
    resume_from_checkpoint: str | None = _help(
        None, "Checkpoint folder to resume from when train() is called without one ('latest': the newest)."
    )

    def __post_init__(self) -> None:
        self.output_dir = os.fspath(self.output_dir) if self.output_dir else ""
        if not self.output_dir:
            raise ValueError("TrainingArguments(output_dir='') is invalid: give the folder for checkpoints.")
        self._check_counts()
        self._check_optimization()
        self._check_strategies()
        self._check_precision_and_compile()
        self._check_distributed()
        self.report_to = self._parse_report_to(self.report_to)
        self.label_names = (
            None if self.label_names is None else _values.name_list(self.label_names, argument="label_names")
        )
        if self.disable_tqdm is None:
            self.disable_tqdm = False

    # -- validation steps -------------------------------------------------------------------------
    def _check_counts(self) -> None:
        _check_int(self, "max_steps", minimum=-1)
        if self.max_steps == 0:
            raise ValueError(
                "TrainingArguments(max_steps=0) is invalid: give a number of steps >= 1, or -1 to train "
                "num_train_epochs epochs."
            )
        if self.max_steps < 0 and not float(self.num_train_epochs) > 0:
            raise ValueError(
                f"TrainingArguments(num_train_epochs={self.num_train_epochs}) is invalid: it must be > 0 "
                "(or set max_steps)."
            )
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
        ):
            _check_int(self, name, minimum=1)
        for name in ("dataloader_num_workers", "warmup_steps"):
            _check_int(self, name, minimum=0)
        if self.save_total_limit is not None:
            _check_int(self, "save_total_limit", minimum=1)
        if self.dataloader_prefetch_factor is not None and self.dataloader_num_workers == 0:
            raise ValueError(
                f"TrainingArguments(dataloader_prefetch_factor={self.dataloader_prefetch_factor}) needs "
                "dataloader_num_workers > 0: without workers nothing is prefetched."
            )
        if self.dataloader_persistent_workers and self.dataloader_num_workers == 0:
            raise ValueError(
                "TrainingArguments(dataloader_persistent_workers=True) needs dataloader_num_workers > 0."
            )

    def _check_optimization(self) -> None:
        for name in ("learning_rate", "weight_decay", "max_grad_norm"):
            if float(getattr(self, name)) < 0:
                raise ValueError(
                    f"TrainingArguments({name}={getattr(self, name)}) is invalid: it must be >= 0."
                )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= float(getattr(self, name)) < 1:
                raise ValueError(
                    f"TrainingArguments({name}={getattr(self, name)}) is invalid: it must be in [0, 1)."
                )
        if not float(self.adam_epsilon) > 0:
            raise ValueError(
                f"TrainingArguments(adam_epsilon={self.adam_epsilon}) is invalid: it must be > 0."
            )
        if not 0 <= float(self.warmup_ratio) <= 1:
            raise ValueError(
                f"TrainingArguments(warmup_ratio={self.warmup_ratio}) is invalid: it must be in [0, 1]."
            )
        self.lr_scheduler_type = _values.check_choice(
            self.lr_scheduler_type, LR_SCHEDULER_TYPES, argument="lr_scheduler_type"
        )
        self.optim = _values.check_choice(self.optim, OPTIMIZERS, argument="optim")

    def _check_strategies(self) -> None:
        for name in ("logging_strategy", "eval_strategy", "save_strategy"):
            setattr(self, name, _values.check_choice(getattr(self, name), STRATEGIES, argument=name))
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # transformers' rule: evaluate as often as we log
        for name in ("logging_steps", "save_steps", "eval_steps"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"TrainingArguments({name}={value!r}) is invalid: it must be a number of steps >= 1, or a "
                    "fraction of the total steps in (0, 1)."
                )
            if value > 1 and value != int(value):
                raise ValueError(
                    f"TrainingArguments({name}={value}) is invalid: a value > 1 must be a whole number of steps."
                )
            setattr(self, name, int(value) if value >= 1 else float(value))

    def _check_precision_and_compile(self) -> None:
        if self.bf16 and self.fp16:
            raise ValueError(
                "TrainingArguments(bf16=True, fp16=True) is invalid: choose one mixed precision (bf16 needs no "
                "loss scaling and is the safer choice where supported)."
            )
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True
        modes = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if self.torch_compile_mode not in modes:
            raise ValueError(
                f"TrainingArguments(torch_compile_mode={self.torch_compile_mode!r}) is invalid: use one of "
                f"{', '.join(m for m in modes if m)}."
            )
        self.gradient_checkpointing_kwargs = _values.load_json_dict(
            self.gradient_checkpointing_kwargs, argument="gradient_checkpointing_kwargs"
        )

    def _check_distributed(self) -> None:
        if self.ddp_backend is not None:
            self.ddp_backend = _values.check_choice(self.ddp_backend, DDP_BACKENDS, argument="ddp_backend")
        _check_int(self, "ddp_timeout", minimum=1)
        if self.ddp_bucket_cap_mb is not None:
            _check_int(self, "ddp_bucket_cap_mb", minimum=1)
        self.accelerator_config = _accelerator_config(self.accelerator_config)
        self.fsdp = parse_fsdp_options(self.fsdp)
        self.fsdp_config = normalize_fsdp_config(
            _values.load_json_dict(self.fsdp_config, argument="fsdp_config")
        )
        self.deepspeed = _values.load_json_dict(self.deepspeed, argument="deepspeed")
        if self.fsdp and self.deepspeed:
            raise ValueError(
                "TrainingArguments sets both fsdp and deepspeed: they are two ways of sharding the model; choose one."
            )

    @staticmethod
    def _parse_report_to(value: Any) -> list[str]:
        names = [n.lower() for n in _values.name_list(value, argument="report_to")]
        if names == ["none"] or not names:
            return []
        for name in names:
            _values.check_choice(name, TRACKERS, argument="report_to")
        return names

    # -- derived values ---------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str | None:
        """``"bf16"``, ``"fp16"`` or None (None leaves the launcher's setting in force)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def warmup_steps_for(self, total_steps: int) -> int:
        """Warm-up steps for a run of ``total_steps`` optimizer steps."""
        return self.warmup_steps if self.warmup_steps > 0 else int(-(-total_steps * self.warmup_ratio // 1))

    def to_dict(self) -> dict[str, Any]:
        """The arguments as plain values (for trackers and ``trainer_state.json``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # -- command line -----------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
        """Add one ``--name`` option per field to ``parser`` (``defaults`` replaces field defaults)."""
        from lockstep.trainer._cli import add_fields

        add_fields(cls, parser, defaults or {})

    @classmethod
    def from_cli(
        cls, argv: Sequence[str] | None = None, *, defaults: dict[str, Any] | None = None
    ) -> TrainingArguments:
        """Parse ``argv`` (default ``sys.argv[1:]``); an unknown option is an error (exit code 2).

        Example:
            >>> TrainingArguments.from_cli(["--learning_rate", "3e-5", "--bf16"]).learning_rate
            3e-05
        """
        from lockstep.trainer._cli import parse

        args, _ = parse(cls, argv, defaults or {}, parser=None, allow_unknown=False)
        return args

    @classmethod
    def parse_known_cli(
        cls, argv: Sequence[str] | None = None, *, defaults: dict[str, Any] | None = None
    ) -> tuple[TrainingArguments, list[str]]:
        """Like :meth:`from_cli`, but returns the options it does not know instead of failing."""
        from lockstep.trainer._cli import parse

        args, rest = parse(cls, argv, defaults or {}, parser=None, allow_unknown=True)
        return args, rest

    @classmethod
    def from_cli_with(
        cls,
        parser: argparse.ArgumentParser,
        argv: Sequence[str] | None = None,
        *,
        defaults: dict[str, Any] | None = None,
    ) -> tuple[TrainingArguments, argparse.Namespace]:
        """Parse the script's own options (``parser``) and the TrainingArguments options together.

        Returns the arguments and a namespace holding only ``parser``'s own options; ``--help`` lists both.

        Example:
            >>> parser = argparse.ArgumentParser()
            >>> _ = parser.add_argument("--data")
            >>> args, own = TrainingArguments.from_cli_with(parser, ["--data", "x.csv", "--seed", "1"])
            >>> own.data, args.seed
            ('x.csv', 1)
        """
        from lockstep.trainer._cli import parse

        return parse(cls, argv, defaults or {}, parser=parser, allow_unknown=False)


def _check_int(args: TrainingArguments, name: str, *, minimum: int) -> None:
    value = getattr(args, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"TrainingArguments({name}={value!r}) is invalid: it must be an integer >= {minimum}."
        )


def _accelerator_config(value: Any) -> dict[str, Any]:
    loaded = _values.load_json_dict(value, argument="accelerator_config") or {}
    unknown = sorted(set(loaded) - set(ACCELERATOR_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(
            f"TrainingArguments(accelerator_config) has unknown key(s) {unknown}; known keys: "
            f"{', '.join(ACCELERATOR_CONFIG_DEFAULTS)}."
        )
    merged = {**ACCELERATOR_CONFIG_DEFAULTS, **loaded}
    for key, item in merged.items():
        allowed = (bool, type(None)) if key == "dispatch_batches" else (bool,)
        if not isinstance(item, allowed):
            raise ValueError(
                f"TrainingArguments(accelerator_config) {key}={item!r} is invalid: it must be true or false"
                + (" (or null)." if key == "dispatch_batches" else ".")
            )
    return merged
