"""The validation steps of ``TrainingArguments.__post_init__`` and the names each choice accepts.

Kept apart from the dataclass so that the field list stays readable; imports nothing heavy (torch only
when ``tf32`` is set, to ask whether the GPU supports it). The order of the steps follows transformers'
``__post_init__``: defaults and aliases, derived values, then the checks of combinations.
"""

from __future__ import annotations

import os
from typing import Any

from lockstep.config.activation_policy import parse_activation_policy
from lockstep.trainer import _argument_parsers
from lockstep.trainer._optimizer_menu import check_optim, optimizer_kwargs
from lockstep.trainer.accelerator_config import AcceleratorConfig

# The TrainingArguments being validated; typed loosely because arguments.py imports this module.
TrainingArguments = Any

STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = (*STRATEGIES, "best")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
DDP_BACKENDS = ("nccl", "gloo", "xccl", "hccl", "cncl")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")
TOKENS_SEEN = ("no", "all", "non_padding")
MULTIPROCESSING_CONTEXTS = ("fork", "spawn", "forkserver")
METRICS_INPUTS = ("inputs", "loss")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LR_SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
SCHEDULE_KWARGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "constant": (),
    "constant_with_warmup": (),
    "inverse_sqrt": ("timescale",),
    "reduce_lr_on_plateau": (
        "mode",
        "factor",
        "patience",
        "threshold",
        "threshold_mode",
        "cooldown",
        "min_lr",
        "eps",
    ),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}
"""The ``lr_scheduler_kwargs`` keys each schedule accepts (transformers' names)."""


def check_int(args: TrainingArguments, name: str, *, minimum: int, optional: bool = False) -> None:
    value = getattr(args, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"TrainingArguments({name}={value!r}) is invalid: it must be an integer >= {minimum}"
            + (" (or None)." if optional else ".")
        )


def _check_number(args: TrainingArguments, name: str, low: float, high: float, *, closed_high: bool) -> None:
    value = getattr(args, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (low <= value <= high if closed_high else low <= value < high):
        bracket = "]" if closed_high else ")"
        raise ValueError(
            f"TrainingArguments({name}={value!r}) is invalid: it must be in [{low}, {high}{bracket}."
        )


# -- 1. defaults and aliases ------------------------------------------------------------------------
def _resolve_evaluation_strategy(args: TrainingArguments) -> None:
    """transformers 4's ``evaluation_strategy`` sets ``eval_strategy`` and is then cleared (read eval_strategy)."""
    old = args.evaluation_strategy
    if old is None:
        return
    old = getattr(old, "value", old)
    if args.eval_strategy not in ("no", old):
        raise ValueError(
            f"TrainingArguments(evaluation_strategy={old!r}, eval_strategy={args.eval_strategy!r}) is invalid: "
            "evaluation_strategy is transformers 4's name of eval_strategy. Pass only eval_strategy."
        )
    args.eval_strategy, args.evaluation_strategy = old, None


def _resolve_activation_policy(args: TrainingArguments) -> None:
    """``activation_checkpointing_policy`` (lockstep's field) turns checkpointing on; stored as its name."""
    if args.activation_checkpointing_policy is not None:
        policy = parse_activation_policy(
            args.activation_checkpointing_policy, owner="TrainingArguments(activation_checkpointing_policy)"
        )
        if (
            policy.enabled == (args.activation_checkpointing is False)
            and args.activation_checkpointing is not None
        ):
            raise ValueError(
                f"TrainingArguments(activation_checkpointing_policy={policy.name!r}) contradicts "
                f"activation_checkpointing (gradient_checkpointing)={args.activation_checkpointing}. Leave that "
                "unset: the policy decides (none: off)."
            )
        args.activation_checkpointing_policy = policy.name
        if policy.enabled:
            args.activation_checkpointing = True
    if args.activation_checkpointing is None:
        args.activation_checkpointing = False
    args.gradient_checkpointing = args.activation_checkpointing


def resolve_defaults_and_aliases(args: TrainingArguments) -> None:
    _resolve_evaluation_strategy(args)
    if args.output_dir is None:
        args.output_dir = "trainer_output"
    args.output_dir = os.path.expanduser(os.fspath(args.output_dir))
    if not args.output_dir:
        raise ValueError("TrainingArguments(output_dir='') is invalid: give the folder for checkpoints.")
    for name in ("lr_scheduler_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        setattr(args, name, _argument_parsers.load_json_dict(getattr(args, name), argument=name))
    args.liger_kernel_config = _argument_parsers.load_json_dict(
        args.liger_kernel_config, argument="liger_kernel_config"
    )
    # gradient_checkpointing* are transformers 5's aliases of activation_checkpointing*: the new name wins
    # when both are set, and afterwards both read the same.
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))
    _resolve_activation_policy(args)
    if args.disable_tqdm is None:
        args.disable_tqdm = False
    tokens = args.include_num_input_tokens_seen
    if isinstance(tokens, bool):
        tokens = "all" if tokens else "no"
    args.include_num_input_tokens_seen = _argument_parsers.check_choice(
        tokens, TOKENS_SEEN, argument="include_num_input_tokens_seen"
    )
    args.include_for_metrics = _argument_parsers.name_list(
        args.include_for_metrics, argument="include_for_metrics"
    )
    for name in args.include_for_metrics:
        _argument_parsers.check_choice(name, METRICS_INPUTS, argument="include_for_metrics")
    args.debug = _argument_parsers.name_list(args.debug, argument="debug")
    if args.use_cpu:
        args.dataloader_pin_memory = False


# -- 2. counts and numbers --------------------------------------------------------------------------
def check_counts(args: TrainingArguments) -> None:
    check_int(args, "max_steps", minimum=-1)
    if args.max_steps == 0:
        raise ValueError(
            "TrainingArguments(max_steps=0) is invalid: give a number of steps >= 1, or -1 to train "
            "num_train_epochs epochs."
        )
    if args.max_steps < 0 and not float(args.num_train_epochs) > 0:
        raise ValueError(
            f"TrainingArguments(num_train_epochs={args.num_train_epochs}) is invalid: it must be > 0 "
            "(or set max_steps)."
        )
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        check_int(args, name, minimum=1)
    check_int(args, "dataloader_num_workers", minimum=0)
    for name in ("save_total_limit", "torch_empty_cache_steps", "eval_accumulation_steps"):
        check_int(args, name, minimum=1, optional=True)
    _check_warmup_steps(args)
    if args.dataloader_prefetch_factor is not None and args.dataloader_num_workers == 0:
        raise ValueError(
            f"TrainingArguments(dataloader_prefetch_factor={args.dataloader_prefetch_factor}) needs "
            "dataloader_num_workers > 0: without workers nothing is prefetched."
        )
    if args.dataloader_persistent_workers and args.dataloader_num_workers == 0:
        raise ValueError(
            "TrainingArguments(dataloader_persistent_workers=True) needs dataloader_num_workers > 0."
        )
    if args.dataloader_multiprocessing_context is not None:
        _argument_parsers.check_choice(
            args.dataloader_multiprocessing_context,
            MULTIPROCESSING_CONTEXTS,
            argument="dataloader_multiprocessing_context",
        )


def _check_warmup_steps(args: TrainingArguments) -> None:
    value = args.warmup_steps
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(
            f"TrainingArguments(warmup_steps={value!r}) is invalid: give a number of steps >= 1, a fraction of "
            "the total steps in (0, 1), or 0 for no warm-up."
        )
    if value >= 1 and value != int(value):
        raise ValueError(
            f"TrainingArguments(warmup_steps={value}) is invalid: a value >= 1 is a whole number of steps."
        )
    args.warmup_steps = int(value) if value >= 1 or value == 0 else float(value)


# -- 3. strategies ----------------------------------------------------------------------------------
def check_strategies(args: TrainingArguments) -> None:
    for name in ("logging_strategy", "eval_strategy"):
        setattr(args, name, _argument_parsers.check_choice(getattr(args, name), STRATEGIES, argument=name))
    args.save_strategy = _argument_parsers.check_choice(
        args.save_strategy, SAVE_STRATEGIES, argument="save_strategy"
    )
    args.hub_strategy = _argument_parsers.check_choice(
        args.hub_strategy, HUB_STRATEGIES, argument="hub_strategy"
    )
    if args.eval_strategy != "no":
        args.do_eval = True
    if args.eval_strategy == "steps" and not args.eval_steps:
        args.eval_steps = args.logging_steps  # transformers' rule: evaluate as often as we log
    for name in ("logging_steps", "save_steps", "eval_steps"):
        value = getattr(args, name)
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
        setattr(args, name, int(value) if value >= 1 else float(value))
    delay = args.eval_delay
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise ValueError(
            f"TrainingArguments(eval_delay={delay!r}) is invalid: give the epochs or steps to wait (>= 0)."
        )


def derive_best_model_settings(args: TrainingArguments) -> None:
    """``metric_for_best_model`` defaults to ``loss`` where a metric is needed; ``greater_is_better``
    follows its name; ``load_best_model_at_end`` needs checkpoints at evaluated steps."""
    needs_metric = (
        args.load_best_model_at_end
        or args.save_strategy == "best"
        or args.lr_scheduler_type == "reduce_lr_on_plateau"
    )
    if needs_metric and args.metric_for_best_model is None:
        args.metric_for_best_model = "loss"
    if args.greater_is_better is None and args.metric_for_best_model is not None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if args.save_strategy == "best" and args.eval_strategy == "no":
        raise ValueError(
            "TrainingArguments(save_strategy='best') saves when an evaluation finds a new best metric, but "
            "eval_strategy='no' never evaluates. Set eval_strategy='steps' or 'epoch'."
        )
    if not args.load_best_model_at_end or args.save_strategy == "best":
        return
    if args.eval_strategy != args.save_strategy:
        raise ValueError(
            f"TrainingArguments(load_best_model_at_end=True, eval_strategy={args.eval_strategy!r}, "
            f"save_strategy={args.save_strategy!r}) is invalid: the best model is chosen among checkpoints of "
            "evaluated steps, so both strategies must be the same (or save_strategy='best')."
        )
    if args.eval_strategy == "steps":
        _check_save_is_multiple_of_eval(args.save_steps, args.eval_steps)  # type: ignore[arg-type]


def _check_save_is_multiple_of_eval(save_steps: float, eval_steps: float) -> None:
    if (save_steps < 1) != (eval_steps < 1):
        raise ValueError(
            f"TrainingArguments(load_best_model_at_end=True, save_steps={save_steps}, eval_steps={eval_steps}) "
            "is invalid: one is a fraction of the run and the other a number of steps, so saves cannot be "
            "guaranteed to fall on evaluated steps. Give both as steps or both as fractions."
        )
    scale = 1_000_000  # integer arithmetic for fractions such as 0.3 and 0.1
    if round(save_steps * scale) % round(eval_steps * scale) != 0:
        raise ValueError(
            f"TrainingArguments(load_best_model_at_end=True, save_steps={save_steps}, eval_steps={eval_steps}) "
            "is invalid: save_steps must be a multiple of eval_steps, so that every checkpoint was evaluated."
        )


# -- 4. optimizer and schedule ----------------------------------------------------------------------
def check_optimization(args: TrainingArguments) -> None:
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        if float(getattr(args, name)) < 0:
            raise ValueError(f"TrainingArguments({name}={getattr(args, name)}) is invalid: it must be >= 0.")
    for name in ("adam_beta1", "adam_beta2", "label_smoothing_factor"):
        _check_number(args, name, 0, 1, closed_high=False)
    if not float(args.adam_epsilon) > 0:
        raise ValueError(f"TrainingArguments(adam_epsilon={args.adam_epsilon}) is invalid: it must be > 0.")
    _check_number(args, "warmup_ratio", 0, 1, closed_high=True)
    if args.neftune_noise_alpha is not None and not float(args.neftune_noise_alpha) > 0:
        raise ValueError(
            f"TrainingArguments(neftune_noise_alpha={args.neftune_noise_alpha}) is invalid: it must be > 0 "
            "(5 is the paper's usual value), or None to turn NEFTune off."
        )
    args.lr_scheduler_type = _check_schedule(args)
    args.optim = check_optim(args.optim)
    optimizer_kwargs(args.optim, args.optim_args)  # a malformed or unknown key fails now, not at train()


def _check_schedule(args: TrainingArguments) -> str:
    name = args.lr_scheduler_type
    if isinstance(name, str) and name.strip().lower() == "greedy":
        raise NotImplementedError(
            "TrainingArguments(lr_scheduler_type='greedy') is not built in lockstep yet (transformers' GreedyLR). "
            f"Use one of {', '.join(LR_SCHEDULER_TYPES)}."
        )
    name = _argument_parsers.check_choice(name, LR_SCHEDULER_TYPES, argument="lr_scheduler_type")
    unknown = sorted(set(args.lr_scheduler_kwargs or {}) - set(SCHEDULE_KWARGS[name]))
    if unknown:
        known = ", ".join(SCHEDULE_KWARGS[name]) or "none"
        raise ValueError(
            f"TrainingArguments(lr_scheduler_kwargs={args.lr_scheduler_kwargs!r}) is invalid for "
            f"lr_scheduler_type={name!r}: it does not take {', '.join(unknown)} (it takes: {known})."
        )
    if name == "reduce_lr_on_plateau" and args.eval_strategy == "no":
        raise ValueError(
            "TrainingArguments(lr_scheduler_type='reduce_lr_on_plateau') lowers the rate when an evaluated metric "
            "stops improving, but eval_strategy='no' never evaluates. Set eval_strategy='steps' or 'epoch'."
        )
    return name


# -- 5. evaluation, logging -------------------------------------------------------------------------
def check_evaluation_and_logging(args: TrainingArguments) -> None:
    args.log_level = _argument_parsers.check_choice(args.log_level, LOG_LEVELS, argument="log_level")
    args.log_level_replica = _argument_parsers.check_choice(
        args.log_level_replica, LOG_LEVELS, argument="log_level_replica"
    )
    args.train_sampling_strategy = _argument_parsers.check_choice(
        args.train_sampling_strategy, SAMPLING_STRATEGIES, argument="train_sampling_strategy"
    )


# -- 6. precision and compilation -------------------------------------------------------------------
def check_precision_and_compile(args: TrainingArguments) -> None:
    if args.bf16 and args.fp16:
        raise ValueError(
            "TrainingArguments(bf16=True, fp16=True) is invalid: choose one mixed precision (bf16 needs no "
            "loss scaling and is the safer choice where supported)."
        )
    if args.bf16_full_eval and args.fp16_full_eval:
        raise ValueError(
            "TrainingArguments(bf16_full_eval=True, fp16_full_eval=True) is invalid: choose one evaluation dtype."
        )
    if args.torch_compile_backend is not None or args.torch_compile_mode is not None:
        args.torch_compile = True
    if args.torch_compile_mode is not None and args.torch_compile_mode not in COMPILE_MODES:
        raise ValueError(
            f"TrainingArguments(torch_compile_mode={args.torch_compile_mode!r}) is invalid: use one of "
            f"{', '.join(COMPILE_MODES)}."
        )
    if args.tf32:
        _check_tf32_supported()


def _check_tf32_supported() -> None:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8):
        raise ValueError(
            "TrainingArguments(tf32=True) needs an NVIDIA GPU of the Ampere generation or newer, and none is "
            "visible here. Leave tf32 unset (None) or pass tf32=False."
        )


# -- 7. distributed ---------------------------------------------------------------------------------
def check_distributed(args: TrainingArguments) -> None:
    if args.ddp_backend is not None:
        args.ddp_backend = _argument_parsers.check_choice(
            args.ddp_backend, DDP_BACKENDS, argument="ddp_backend"
        )
    check_int(args, "ddp_timeout", minimum=1)
    check_int(args, "ddp_bucket_cap_mb", minimum=1, optional=True)
    args.accelerator_config = AcceleratorConfig.from_value(args.accelerator_config)
    asked = _check_backend_fields(args)
    _check_parallelism_config(args)
    if args.save_only_model and args.load_best_model_at_end and asked:
        raise ValueError(
            f"TrainingArguments(save_only_model=True, load_best_model_at_end=True) with {asked[0]}: the best "
            "model of a model-only checkpoint cannot be loaded into a sharded model (as in transformers). Set "
            "save_only_model=False, or load_best_model_at_end=False."
        )


def _check_backend_fields(args: TrainingArguments) -> list[str]:
    """Each registered backend's fields (``fsdp``, ``deepspeed``) checked and parsed by its spec's
    ``trainer_normalize``; returns the fields that ask for a backend (at most one: two are an error)."""
    from lockstep.config.backend_specs import backend_specs
    from lockstep.config.vocabulary import resolve_target

    asked = []
    for spec in backend_specs():
        if spec.trainer_normalize is not None:
            resolve_target(spec.trainer_normalize)(args)
        if spec.trainer_argument and getattr(args, spec.trainer_argument, None):
            asked.append(spec.trainer_argument)
    if len(asked) > 1:
        raise ValueError(
            f"TrainingArguments sets both {asked[1]} and {asked[0]}: they are two ways of sharding the model; "
            "choose one."
        )
    return asked


def _check_parallelism_config(args: TrainingArguments) -> None:
    from lockstep.config.parallelism import ParallelismConfig

    config = args.parallelism_config
    if config is None:
        return
    if isinstance(config, (str, dict, os.PathLike)):  # the command line's JSON: {"tp_size": 2, ...}
        sizes = _argument_parsers.load_json_dict(config, argument="parallelism_config") or {}
        try:
            config = args.parallelism_config = ParallelismConfig(**sizes)
        except TypeError:
            raise ValueError(
                f"TrainingArguments(parallelism_config={sizes!r}) is invalid: its keys are ParallelismConfig's "
                "arguments (dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size, pp_size, ep_size)."
            ) from None
    if not isinstance(config, ParallelismConfig):
        raise TypeError(
            f"TrainingArguments(parallelism_config=...) must be a ParallelismConfig (from lockstep import "
            f"ParallelismConfig) or a dict of its sizes, got {type(config).__name__}."
        )


def parse_report_to(value: Any) -> list[str]:
    """The tracker names of ``report_to``, as registered (``"none"`` is no tracker): the built-in ones, a
    class registered with ``lockstep.tracking.register_tracker_class`` before the arguments are built, or
    ``"all"`` (every built-in tracker whose package is installed, as ``log_with="all"``)."""
    from lockstep.tracking.registry import find_tracker_name, tracker_choices

    names = _argument_parsers.name_list(value, argument="report_to")
    if [name.strip().lower() for name in names] == ["none"] or not names:
        return []
    found = []
    for name in names:
        registered = find_tracker_name(name)
        if registered is None:
            choices = ", ".join(repr(choice) for choice in (*tracker_choices(), "none"))
            raise ValueError(
                f"TrainingArguments(report_to={name!r}) is invalid: it must be one of {choices}. A tracker "
                "class of your own is accepted once lockstep.tracking.register_tracker_class has registered it "
                "(before the TrainingArguments are built)."
            )
        found.append(registered)
    return found
