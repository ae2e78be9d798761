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
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lockstep.config.enums import BUILT_IN_TRACKERS
from lockstep.layers.long_context.options import LOSS_TYPE_HELP, MODEL_LOSS, check_loss_type
from lockstep.trainer import _argument_parsers
from lockstep.trainer import _arguments_api as _api
from lockstep.trainer import _arguments_post_init as _checks
from lockstep.trainer._arguments_api import ParallelMode
from lockstep.trainer._arguments_post_init import (
    DDP_BACKENDS,
    LOG_LEVELS,
    LR_SCHEDULER_TYPES,
    SAMPLING_STRATEGIES,
    STRATEGIES,
)
from lockstep.trainer._field_status import add_on_fields, check_not_built
from lockstep.trainer._optimizer_menu import OPTIMIZERS
from lockstep.trainer._transformers_version import DEFAULT_OPTIM
from lockstep.trainer.accelerator_config import AcceleratorConfig

if TYPE_CHECKING:
    import torch

__all__ = [
    "ACCELERATOR_CONFIG_DEFAULTS",
    "DDP_BACKENDS",
    "LR_SCHEDULER_TYPES",
    "OPTIMIZERS",
    "STRATEGIES",
    "AcceleratorConfig",
    "TrainingArguments",
]


ACCELERATOR_CONFIG_DEFAULTS: dict[str, Any] = AcceleratorConfig().to_dict()
"""The default ``accelerator_config`` settings."""


def _with_add_on_fields(cls: type) -> type:
    """Give the class (before it becomes a dataclass) the field of each registered add-on and layer that names
    one (``trainer_argument`` in its spec: :func:`lockstep.config.backend_specs.add_on_specs`): a dict (or JSON
    text) of its config section's keys, or its config object; None leaves it off.

    Raises:
        ValueError: an add-on claims a field the class has.
    """
    for spec, help_text in add_on_fields():
        name = spec.trainer_argument or ""
        if name in cls.__annotations__:
            raise ValueError(
                f"The {spec.name!r} add-on claims the TrainingArguments field {name!r}, which TrainingArguments has "
                "already; give its spec another trainer_argument."
            )
        cls.__annotations__[name] = "dict | str | None"
        setattr(cls, name, field(default=None, metadata={"help": help_text}))
    return cls


def _help(default: Any, text: str) -> Any:
    """A field with an immutable default and its ``--help`` text."""
    return field(default=default, metadata={"help": text})


@dataclass(kw_only=True)
@_with_add_on_fields
class TrainingArguments:
    """Settings of a :class:`~lockstep.Trainer` run (transformers' ``TrainingArguments`` names).

    Each field's help text is also its ``--help`` line in :meth:`from_cli`.

    The annotations are in the forms transformers' ``HfArgumentParser`` reads (4.40 to 5.x), as transformers
    writes them: in a union with ``None`` the parser keeps the *second* member, so ``list[str] | str | None``
    and ``dict | str | None`` take one text on its command line (a name list, JSON text or a file path); a
    union of ``bool`` and ``str`` is read as a bool. ``accelerator_config`` and ``parallelism_config`` also take
    an ``AcceleratorConfig`` / ``ParallelismConfig`` object.
    """

    # -- output and run length ------------------------------------------------------------------
    output_dir: str | None = _help(
        None, "Folder for checkpoints (checkpoint-<step>) and the final model (default: 'trainer_output')."
    )
    overwrite_output_dir: bool = _help(
        False, "Read by transformers 4 scripts to start over in a non-empty output_dir (not by the Trainer)."
    )
    logging_dir: str | None = _help(
        None,
        "Folder for tracker files (report_to); default: output_dir. (lockstep; removed in transformers 5.)",
    )
    run_name: str | None = _help(None, "Name of the run for the trackers; default: 'trainer'.")
    do_train: bool = _help(False, "Whether the script trains (read by scripts, not by the Trainer).")
    do_eval: bool = _help(False, "Whether the script evaluates (set when eval_strategy is not 'no').")
    do_predict: bool = _help(False, "Whether the script predicts (read by scripts, not by the Trainer).")
    num_train_epochs: float = _help(3.0, "Epochs to train (fractions allowed); ignored when max_steps > 0.")
    max_steps: int = _help(-1, "Total optimizer steps; -1 trains num_train_epochs epochs instead.")
    per_device_train_batch_size: int = _help(8, "Training batch size of each process.")
    per_device_eval_batch_size: int = _help(8, "Evaluation batch size of each process.")
    gradient_accumulation_steps: int = _help(
        1, "Micro-batches per optimizer step (the Trainer accumulates; do not also set it on the launcher)."
    )
    auto_find_batch_size: bool = _help(
        False,
        "Halve per_device_train_batch_size after an out-of-memory error until a step fits (all ranks agree).",
    )
    # -- optimizer and schedule -----------------------------------------------------------------
    learning_rate: float = _help(5e-5, "Peak learning rate.")
    lr_scheduler_type: str = _help("linear", f"Learning-rate schedule: {', '.join(LR_SCHEDULER_TYPES)}.")
    lr_scheduler_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": 'Extra arguments of the schedule (dict, JSON text or file), e.g. {"num_cycles": 2}.'
        },
    )
    warmup_steps: float = _help(
        0, "Linear warm-up: a number of steps (>= 1) or a fraction of the total steps (< 1)."
    )
    warmup_ratio: float = _help(
        0.0,
        "Warm-up as a fraction of the total steps when warmup_steps is 0 (lockstep; transformers 4 name).",
    )
    optim: str = _help(
        DEFAULT_OPTIM,
        f"Optimizer: {', '.join(OPTIMIZERS)} (default: the installed transformers' default, adamw_torch_fused "
        "on transformers >= 4.54 with torch >= 2.8, else adamw_torch).",
    )
    optim_args: str | None = _help(
        None, "Extra optimizer arguments as 'key=value,key=value' (e.g. momentum=0.9)."
    )
    optim_target_modules: list[str] | str | None = field(
        default=None,
        metadata={"help": "Modules GaLore/APOLLO optimizers apply to (those optimizers are not built)."},
    )
    weight_decay: float = _help(0.0, "Weight decay (never applied to biases and normalization layers).")
    adam_beta1: float = _help(0.9, "Adam beta1.")
    adam_beta2: float = _help(0.999, "Adam beta2.")
    adam_epsilon: float = _help(1e-8, "Adam epsilon.")
    max_grad_norm: float = _help(1.0, "Clip the gradient norm to this value (0 disables clipping).")
    label_smoothing_factor: float = _help(
        0.0, "Label smoothing of the cross-entropy loss, in [0, 1) (0: none); needs logits and labels."
    )
    loss_type: str = _help(MODEL_LOSS, LOSS_TYPE_HELP)
    average_tokens_across_devices: bool = _help(
        True,
        "Sum num_items_in_batch (the label tokens of an accumulation cycle) over all processes, so the loss "
        "is the mean over the label tokens of the whole step; False: over this process's tokens.",
    )
    # -- precision, memory, speed ---------------------------------------------------------------
    bf16: bool = _help(False, "Train with bfloat16 autocast.")
    fp16: bool = _help(False, "Train with float16 autocast and loss scaling.")
    bf16_full_eval: bool = _help(False, "Evaluate with the model cast to bfloat16 (not built).")
    fp16_full_eval: bool = _help(False, "Evaluate with the model cast to float16 (not built).")
    tf32: bool | None = _help(
        None, "Allow TensorFloat-32 matmuls on Ampere+ GPUs (None: leave torch's setting)."
    )
    activation_checkpointing: bool | None = _help(
        None, "Recompute activations in backward (transformers models); the transformers 5 name."
    )
    activation_checkpointing_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Arguments of activation checkpointing (default: use_reentrant=False)."},
    )
    gradient_checkpointing: bool | None = _help(None, "Alias of activation_checkpointing.")
    activation_checkpointing_policy: str | None = _help(
        None,
        "lockstep only: what each layer (the model's _no_split_modules) keeps for backward: full (what "
        "activation_checkpointing=True does), every_<k> (recompute every k-th layer), op (keep matmul and "
        "attention outputs, recompute the cheap operators) or offload (keep activations in CPU memory). "
        "Setting it other than none turns activation checkpointing on.",
    )
    gradient_checkpointing_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Alias of activation_checkpointing_kwargs."}
    )
    torch_compile: bool = _help(False, "Compile the model with torch.compile.")
    torch_compile_backend: str | None = _help(
        None, "torch.compile backend (default inductor); implies torch_compile."
    )
    torch_compile_mode: str | None = _help(None, "torch.compile mode; implies torch_compile.")
    use_liger_kernel: bool = _help(False, "Liger kernels (not built: needs liger-kernel).")
    liger_kernel_config: dict | None = field(
        default=None, metadata={"help": "Liger kernel settings (not built)."}
    )
    use_cache: bool = _help(False, "Set model.config.use_cache (the KV cache is useless in training).")
    neftune_noise_alpha: float | None = _help(
        None, "NEFTune: uniform noise on the input embeddings in training, scaled alpha / sqrt(length * dim)."
    )
    torch_empty_cache_steps: int | None = _help(
        None, "Empty the device's caching allocator every N optimizer steps (saves memory, costs time)."
    )
    # -- logging --------------------------------------------------------------------------------
    logging_strategy: str = _help("steps", "When to log the training loss: no, steps, epoch.")
    logging_steps: float = _help(500, "Log every N optimizer steps (a value < 1 is a fraction of the total).")
    logging_first_step: bool = _help(False, "Also log after the first optimizer step.")
    log_on_each_node: bool = _help(
        True, "log_level applies to the first process of each node (False: only to the job's first process)."
    )
    logging_nan_inf_filter: bool = _help(
        True, "A nan/inf step loss counts as the mean loss since the last log (the logged loss stays finite)."
    )
    include_num_input_tokens_seen: str | bool = _help(
        "no", "Count input tokens in state.num_input_tokens_seen: 'no', 'all' (True), 'non_padding'."
    )
    log_level: str = _help(
        "passive", f"Level of the 'lockstep' logger on the main process: {', '.join(LOG_LEVELS)}."
    )
    log_level_replica: str = _help("warning", "Level of the 'lockstep' logger on the other processes.")
    disable_tqdm: bool | None = _help(None, "Hide the progress bar (also LOCKSTEP_DISABLE_PROGRESS_BARS=1).")
    report_to: list[str] | str | None = field(
        default="none",
        metadata={
            "help": f"Trackers: {', '.join(BUILT_IN_TRACKERS)}, a name given to register_tracker_class, all "
            "or none (list or comma-separated)."
        },
    )
    project: str = _help("huggingface", "Trackio project (not built: lockstep has no Trackio tracker).")
    trackio_space_id: str | None = _help(None, "Trackio Space (not built).")
    trackio_bucket_id: str | None = _help(None, "Trackio bucket (not built).")
    trackio_static_space_id: str | None = _help(None, "Trackio static Space (not built).")
    # -- evaluation -----------------------------------------------------------------------------
    eval_strategy: str = _help("no", "When to evaluate during training: no, steps, epoch.")
    evaluation_strategy: str | None = _help(
        None, "transformers 4's name of eval_strategy: sets it, then reads None (the two must agree)."
    )
    use_legacy_prediction_loop: bool = _help(
        False, "transformers 4's old prediction loop (not built: evaluation_loop is the only loop)."
    )
    tpu_metrics_debug: bool = _help(
        False, "transformers 4's TPU debug metrics switch, read by its trainer_qa.py (not built: no TPU)."
    )
    eval_steps: float | None = _help(
        None, "Evaluate every N steps (default: logging_steps); < 1: a fraction."
    )
    eval_delay: float = _help(
        0, "Epochs (eval_strategy='epoch') or steps to wait before the first evaluation."
    )
    prediction_loss_only: bool = _help(False, "evaluate/predict return only the loss (no predictions kept).")
    eval_on_start: bool = _help(False, "Evaluate once before the first training step (a sanity check).")
    eval_do_concat_batches: bool = _help(
        True, "Concatenate the predictions of all batches (False: a list with one array per batch)."
    )
    eval_use_gather_object: bool = _help(
        False, "Gather non-tensor predictions as Python objects (not built)."
    )
    eval_accumulation_steps: int | None = _help(
        None, "Move gathered predictions to the CPU every N evaluation steps (default: every step)."
    )
    include_for_metrics: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Also give compute_metrics 'inputs' and/or 'loss' (EvalPrediction.inputs / .losses)."
        },
    )
    batch_eval_metrics: bool = _help(
        False,
        "Call compute_metrics(EvalPrediction, compute_result) on every batch instead of once at the end.",
    )
    # -- checkpoints ----------------------------------------------------------------------------
    save_safetensors: bool = _help(
        True,
        "Save weights as safetensors (transformers 4's switch; lockstep always does, False is not built).",
    )
    save_only_model: bool = _help(
        False, "Checkpoints of the weights alone, without optimizer, scheduler and RNG state (no resume)."
    )
    save_strategy: str = _help("steps", "When to save a checkpoint: no, steps, epoch, best.")
    save_steps: float = _help(500, "Save every N steps (a value < 1 is a fraction of the total).")
    save_on_each_node: bool = _help(
        False, "Save on every node's main process (node-local disks), not once per job."
    )
    save_total_limit: int | None = _help(
        None, "Keep at most this many checkpoints (oldest removed first; the best one is never removed)."
    )
    enable_jit_checkpoint: bool = _help(
        False, "Checkpoint on SIGTERM (lockstep's Trainer always does: preemption saves and exits)."
    )
    push_to_hub: bool = _help(False, "Upload to the Hugging Face Hub (not built).")
    hub_token: str | None = _help(None, "Hub token (not built).")
    hub_private_repo: bool | None = _help(None, "Private Hub repository (not built).")
    hub_model_id: str | None = _help(None, "Hub repository name (not built).")
    hub_strategy: str = _help("every_save", "When to push to the Hub (not built).")
    hub_always_push: bool = _help(False, "Push even while a push runs (not built).")
    hub_revision: str | None = _help(None, "Hub branch (not built).")
    load_best_model_at_end: bool = _help(
        False, "Load the checkpoint with the best metric_for_best_model at the end of train()."
    )
    metric_for_best_model: str | None = _help(
        None, "Metric that ranks checkpoints ('eval_' prefix optional; default 'loss' when needed)."
    )
    greater_is_better: bool | None = _help(
        None, "Whether a larger metric is better (default: False for names ending in 'loss')."
    )
    ignore_data_skip: bool = _help(
        False, "On resume, restart the epoch's data instead of skipping (not built)."
    )
    restore_callback_states_from_checkpoint: bool = _help(
        False, "Restore stateful callbacks (EarlyStoppingCallback) from the checkpoint on resume."
    )
    # -- reproducibility and devices ------------------------------------------------------------
    full_determinism: bool = _help(False, "Deterministic algorithms everywhere (slower); seeds as seed.")
    seed: int = _help(42, "Seed of Python, NumPy and torch, set when the Trainer is created.")
    data_seed: int | None = _help(None, "Seed of the data order (default: seed).")
    use_cpu: bool = _help(False, "Train on the CPU even when a GPU is present.")
    local_rank: int = _help(-1, "Set by launchers; lockstep reads LOCAL_RANK from the environment instead.")
    accelerator_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Dict, JSON text or JSON file: split_batches, dispatch_batches, even_batches, use_seedable_sampler, "
            "non_blocking, gradient_accumulation_kwargs, use_configured_state. Becomes an AcceleratorConfig "
            "(args.accelerator_config.even_batches)."
        },
    )
    parallelism_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "A ParallelismConfig (or a dict / JSON of its sizes: tp_size, dp_shard_size, dp_replicate_size): "
            "the device mesh for tensor parallel, FSDP and HSDP. A model loaded with tp_plan='auto' sets tp_size "
            "by itself."
        },
    )
    # -- data -----------------------------------------------------------------------------------
    dataloader_drop_last: bool = _help(False, "Drop the last incomplete training batch.")
    dataloader_num_workers: int = _help(0, "Worker processes loading data (0: in the training process).")
    dataloader_pin_memory: bool = _help(True, "Pin host memory of batches (faster copies to a GPU).")
    dataloader_persistent_workers: bool = _help(False, "Keep data workers alive between epochs.")
    dataloader_prefetch_factor: int | None = _help(None, "Batches each worker loads ahead (needs workers).")
    dataloader_multiprocessing_context: str | None = _help(
        None, "Start method of data workers: fork, spawn or forkserver."
    )
    dataloader_in_order: bool = _help(True, "Workers return batches in order (False is not built).")
    remove_unused_columns: bool = _help(True, "Drop example keys that the model's forward does not accept.")
    label_names: list[str] | None = field(
        default=None, metadata={"help": "Batch keys holding the labels (default: the model's, or 'labels')."}
    )
    train_sampling_strategy: str = _help(
        "random", f"Order of training examples: {', '.join(SAMPLING_STRATEGIES)}."
    )
    length_column_name: str = _help("length", "Column holding example lengths for group_by_length.")
    # -- distributed ----------------------------------------------------------------------------
    ddp_find_unused_parameters: bool | None = _help(
        None, "DDP find_unused_parameters (default: not gradient_checkpointing for transformers models)."
    )
    ddp_bucket_cap_mb: int | None = _help(None, "DDP gradient bucket size in MiB.")
    ddp_broadcast_buffers: bool | None = _help(None, "DDP broadcast_buffers (default True).")
    ddp_static_graph: bool | None = _help(None, "DDP static_graph (the graph is the same every step).")
    ddp_backend: str | None = _help(None, f"Process-group backend: {', '.join(DDP_BACKENDS)}.")
    ddp_timeout: int = _help(1800, "Seconds a collective may wait before the run fails.")
    fsdp: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "FSDP options: full_shard or shard_grad_op, plus offload and/or auto_wrap (e.g. 'full_shard auto_wrap')."
        },
    )
    fsdp_config: dict | str | None = field(
        default=None, metadata={"help": "FSDP settings: dict, JSON text or JSON file."}
    )
    deepspeed: dict | str | None = field(
        default=None, metadata={"help": "DeepSpeed config: dict, JSON text or JSON file."}
    )
    elastic_keep_global_batch: bool = _help(
        False,
        "lockstep extension: when resuming on another number of processes, keep the global batch by changing "
        "gradient_accumulation_steps (when the division is exact; else a clear error) instead of letting it "
        "follow the number of processes (Accelerator(elastic_keep_global_batch=True)).",
    )
    debug: str | list[str] = field(
        default="", metadata={"help": "Debug options: underflow_overflow, tpu_metrics_debug (not built)."}
    )
    skip_memory_metrics: bool = _help(True, "Skip memory metrics (False is not built).")
    resume_from_checkpoint: str | None = _help(
        None, "Checkpoint folder to resume from when train() is called without one ('latest': the newest)."
    )

    def __post_init__(self) -> None:
        # The order follows transformers' __post_init__: defaults and aliases, derived values, then checks.
        _checks.resolve_defaults_and_aliases(self)
        _checks.check_counts(self)
        _checks.check_strategies(self)
        _checks.check_optimization(self)
        self.loss_type = check_loss_type(self.loss_type)
        _checks.derive_best_model_settings(self)
        _checks.check_evaluation_and_logging(self)
        _checks.check_precision_and_compile(self)
        _checks.check_distributed(self)
        self.report_to = _checks.parse_report_to(self.report_to)
        self.label_names = (
            None
            if self.label_names is None
            else _argument_parsers.name_list(self.label_names, argument="label_names")
        )
        check_not_built(self)

    # -- derived values ---------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str | None:
        """``"bf16"``, ``"fp16"`` or None (None leaves the launcher's setting in force)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def warmup_steps_for(self, total_steps: int) -> int:
        """Warm-up steps for a run of ``total_steps`` optimizer steps (transformers' ``get_warmup_steps``)."""
        return _api.get_warmup_steps(self, total_steps)

    # -- transformers' methods and properties beyond the fields (see _arguments_api) ----------------
    default_optim = DEFAULT_OPTIM

    @property
    def ddp_timeout_delta(self) -> timedelta:
        """``ddp_timeout`` as the ``timedelta`` ``init_process_group`` takes."""
        return _api.ddp_timeout_delta(self)

    @property
    def device(self) -> torch.device:
        """The device of this process (the CPU with ``use_cpu=True``)."""
        return _api.device(self)

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a GPU, 0 on the CPU (lockstep never runs ``nn.DataParallel``, so a
        process with several visible GPUs still uses one)."""
        return _api.n_gpu(self)

    @property
    def parallel_mode(self) -> ParallelMode:
        """``ParallelMode.DISTRIBUTED`` with more than one process, else ``ParallelMode.NOT_PARALLEL``."""
        return _api.parallel_mode(self)

    @property
    def world_size(self) -> int:
        """The number of processes of the job."""
        return _api.world_size(self)

    @property
    def process_index(self) -> int:
        """This process's rank in the job."""
        return _api.process_index(self)

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return _api.local_process_index(self)

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the first of each node (``log_on_each_node``), else the first of the job."""
        return _api.should_log(self)

    @property
    def should_save(self) -> bool:
        """Whether this process writes to disk: the first of each node (``save_on_each_node``), else of the job."""
        return _api.should_save(self)

    @property
    def train_batch_size(self) -> int:
        """The batch size of one process's step (``per_device_train_batch_size``: one device per process)."""
        return _api.train_batch_size(self)

    @property
    def eval_batch_size(self) -> int:
        """The evaluation batch size of one process (``per_device_eval_batch_size``)."""
        return _api.eval_batch_size(self)

    def get_process_log_level(self) -> int:
        """The log level of this process: ``log_level`` where :attr:`should_log`, else ``log_level_replica``;
        ``"passive"`` is the ``lockstep`` logger's current level.

        Example:
            >>> from lockstep import TrainingArguments
            >>> TrainingArguments(log_level="info").get_process_log_level()
            20
        """
        return _api.get_process_log_level(self)

    def main_process_first(self, local: bool = True, desc: str = "work") -> AbstractContextManager[None]:
        """Run the block on the first process (of each node with ``local=True``) first, then on the others: for
        ``datasets.map`` whose cache the others then read. One process: just runs the block.

        Example:
            >>> from lockstep import TrainingArguments
            >>> with TrainingArguments().main_process_first(desc="tokenize"):
            ...     pass
        """
        return _api.main_process_first(self, local, desc)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up steps of a run of ``num_training_steps``: ``warmup_steps`` when >= 1, else that fraction (or
        ``warmup_ratio``) of the steps, rounded up."""
        return _api.get_warmup_steps(self, num_training_steps)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (tokens hidden, config objects as dicts), as transformers writes them."""
        return _api.to_dict(self)

    def to_json_string(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return _api.to_json_string(self)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` plus the batch sizes, every value a bool, int, float or str (TensorBoard's hparams)."""
        return _api.to_sanitized_dict(self)

    # -- transformers' grouped setters ----------------------------------------------------------------
    # Each sets its group of fields, checks the result as the constructor does (see _rebuilt) and returns the
    # arguments. Defaults and parameter names are transformers 5.24's.
    def set_training(
        self,
        learning_rate: float = 5e-5,
        batch_size: int = 8,
        weight_decay: float = 0,
        num_epochs: float = 3,
        max_steps: int = -1,
        gradient_accumulation_steps: int = 1,
        seed: int = 42,
        activation_checkpointing: bool = False,
        gradient_checkpointing: bool | None = None,
    ) -> TrainingArguments:
        """Set the basic training values (and ``do_train=True``).

        Example:
            >>> args = TrainingArguments(output_dir="runs/a").set_training(learning_rate=1e-4, batch_size=32)
            >>> args.learning_rate, args.per_device_train_batch_size
            (0.0001, 32)
        """
        if gradient_checkpointing is not None:
            activation_checkpointing = gradient_checkpointing
        return _rebuilt(
            self,
            do_train=True,
            learning_rate=learning_rate,
            per_device_train_batch_size=batch_size,
            weight_decay=weight_decay,
            num_train_epochs=num_epochs,
            max_steps=max_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            seed=seed,
            activation_checkpointing=activation_checkpointing,
            gradient_checkpointing=activation_checkpointing,
        )

    def set_evaluate(
        self,
        strategy: str = "no",
        steps: int = 500,
        batch_size: int = 8,
        accumulation_steps: int | None = None,
        delay: float | None = None,
        loss_only: bool = False,
    ) -> TrainingArguments:
        """Set when and how to evaluate (``do_eval`` follows ``strategy``)."""
        _check_steps(strategy, steps, "set_evaluate")
        return _rebuilt(
            self,
            eval_strategy=getattr(strategy, "value", strategy),
            do_eval=str(getattr(strategy, "value", strategy)).lower() != "no",
            eval_steps=steps,
            per_device_eval_batch_size=batch_size,
            eval_accumulation_steps=accumulation_steps,
            eval_delay=0 if delay is None else delay,
            prediction_loss_only=loss_only,
        )

    def set_testing(self, batch_size: int = 8, loss_only: bool = False) -> TrainingArguments:
        """Set the prediction batch size (and ``do_predict=True``)."""
        return _rebuilt(
            self, do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only
        )

    def set_save(
        self,
        strategy: str = "steps",
        steps: int = 500,
        total_limit: int | None = None,
        on_each_node: bool = False,
    ) -> TrainingArguments:
        """Set when checkpoints are saved and how many are kept."""
        _check_steps(strategy, steps, "set_save")
        return _rebuilt(
            self,
            save_strategy=getattr(strategy, "value", strategy),
            save_steps=steps,
            save_total_limit=total_limit,
            save_on_each_node=on_each_node,
        )

    def set_logging(
        self,
        strategy: str = "steps",
        steps: int = 500,
        report_to: str | list[str] = "none",
        level: str = "passive",
        first_step: bool = False,
        nan_inf_filter: bool = False,
        on_each_node: bool = False,
        replica_level: str = "passive",
    ) -> TrainingArguments:
        """Set when and where the run logs."""
        _check_steps(strategy, steps, "set_logging")
        return _rebuilt(
            self,
            logging_strategy=getattr(strategy, "value", strategy),
            logging_steps=steps,
            report_to=report_to,
            log_level=level,
            logging_first_step=first_step,
            logging_nan_inf_filter=nan_inf_filter,
            log_on_each_node=on_each_node,
            log_level_replica=replica_level,
        )

    def set_push_to_hub(
        self,
        model_id: str,
        strategy: str = "every_save",
        token: str | None = None,
        private_repo: bool | None = None,
        always_push: bool = False,
        revision: str | None = None,
    ) -> TrainingArguments:
        """Refused: lockstep does not upload (``push_to_hub=True`` raises the arguments' NotImplementedError)."""
        return _rebuilt(
            self,
            push_to_hub=True,
            hub_model_id=model_id,
            hub_strategy=strategy,
            hub_token=token,
            hub_private_repo=private_repo,
            hub_always_push=always_push,
            hub_revision=revision,
        )

    def set_optimizer(
        self,
        name: str = "adamw_torch",
        learning_rate: float = 5e-5,
        weight_decay: float = 0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        args: str | None = None,
    ) -> TrainingArguments:
        """Set the optimizer and its hyperparameters."""
        return _rebuilt(
            self,
            optim=getattr(name, "value", name),
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            adam_beta1=beta1,
            adam_beta2=beta2,
            adam_epsilon=epsilon,
            optim_args=args,
        )

    def set_lr_scheduler(
        self, name: str = "linear", num_epochs: float = 3.0, max_steps: int = -1, warmup_steps: float = 0
    ) -> TrainingArguments:
        """Set the learning-rate schedule and the run's length."""
        return _rebuilt(
            self,
            lr_scheduler_type=getattr(name, "value", name),
            num_train_epochs=num_epochs,
            max_steps=max_steps,
            warmup_steps=warmup_steps,
        )

    def set_dataloader(
        self,
        train_batch_size: int = 8,
        eval_batch_size: int = 8,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | None = None,
        in_order: bool = True,
        auto_find_batch_size: bool = False,
        ignore_data_skip: bool = False,
        sampler_seed: int | None = None,
    ) -> TrainingArguments:
        """Set the batch sizes and the data loaders' options."""
        return _rebuilt(
            self,
            per_device_train_batch_size=train_batch_size,
            per_device_eval_batch_size=eval_batch_size,
            dataloader_drop_last=drop_last,
            dataloader_num_workers=num_workers,
            dataloader_pin_memory=pin_memory,
            dataloader_persistent_workers=persistent_workers,
            dataloader_prefetch_factor=prefetch_factor,
            dataloader_multiprocessing_context=multiprocessing_context,
            dataloader_in_order=in_order,
            auto_find_batch_size=auto_find_batch_size,
            ignore_data_skip=ignore_data_skip,
            data_seed=sampler_seed,
        )

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


def _rebuilt(args: TrainingArguments, **updates: Any) -> TrainingArguments:
    """Rebuild ``args`` with ``updates`` (every check of the constructor runs, so an invalid combination raises
    the constructor's error and leaves ``args`` unchanged), then take the new values into ``args``."""
    current = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
    rebuilt = type(args)(**{**current, **updates})
    args.__dict__.update(rebuilt.__dict__)
    return args


def _check_steps(strategy: Any, steps: float, setter: str) -> None:
    if str(getattr(strategy, "value", strategy)).lower() == "steps" and steps == 0:
        raise ValueError(
            f"{setter}(strategy='steps', steps=0) is invalid: set steps >= 1 (or a fraction < 1)."
        )
