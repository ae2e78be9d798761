"""Every field of transformers' ``TrainingArguments`` and what lockstep does with it.

``FIELD_STATUS`` is the checked-in list (a test keeps it equal to the installed transformers' fields):

* ``implemented``: the field has transformers' meaning here.
* ``accepted``: the field is taken and the note says how lockstep's behaviour differs.
* ``not built``: the default is accepted; any other value raises ``NotImplementedError`` when the
  arguments are constructed (never after training), saying what to do instead.

``LOCKSTEP_ONLY`` lists lockstep's fields that transformers 5 does not have, and :func:`add_on_fields` the
fields that registered add-ons and layers add (fault tolerance's ``fault_tolerance``).
"""

from __future__ import annotations

from typing import Any

# The TrainingArguments being validated; typed loosely because arguments.py imports this module.
TrainingArguments = Any

IMPLEMENTED, ACCEPTED, NOT_BUILT = "implemented", "accepted", "not built"

_NOT_BUILT: dict[str, tuple[tuple[Any, ...], str]] = {
    "bf16_full_eval": ((False,), "evaluate in autocast with bf16=True instead"),
    "fp16_full_eval": ((False,), "evaluate in autocast with fp16=True instead"),
    "use_liger_kernel": (
        (False,),
        "Liger kernels need liger-kernel (pip install liger-kernel), which lockstep does not wire",
    ),
    "liger_kernel_config": ((None,), "Liger kernels are not wired (see use_liger_kernel)"),
    "project": (
        ("huggingface",),
        "it names a Trackio project and lockstep has no Trackio tracker; use run_name and report_to",
    ),
    "trackio_space_id": ((None,), "lockstep has no Trackio tracker"),
    "trackio_bucket_id": ((None,), "lockstep has no Trackio tracker"),
    "trackio_static_space_id": ((None,), "lockstep has no Trackio tracker"),
    "push_to_hub": (
        (False,),
        "uploading needs huggingface_hub (pip install huggingface_hub) and network access, and lockstep does not upload; push output_dir yourself with huggingface_hub.upload_folder",
    ),
    "hub_token": ((None,), "lockstep does not upload to the Hub (see push_to_hub)"),
    "hub_private_repo": ((None,), "lockstep does not upload to the Hub (see push_to_hub)"),
    "hub_model_id": ((None,), "lockstep does not upload to the Hub (see push_to_hub)"),
    "hub_strategy": (("every_save",), "lockstep does not upload to the Hub (see push_to_hub)"),
    "hub_always_push": ((False,), "lockstep does not upload to the Hub (see push_to_hub)"),
    "hub_revision": ((None,), "lockstep does not upload to the Hub (see push_to_hub)"),
    "ignore_data_skip": ((False,), "a resumed run always continues at the next unseen batch (exactly)"),
    "dataloader_in_order": ((True,), "worker batches always arrive in order"),
    "debug": (([],), "underflow/overflow detection and TPU metrics are not built"),
    "skip_memory_metrics": ((True,), "the Trainer reports no memory metrics; see lockstep.memory"),
    "optim_target_modules": ((None,), "it selects modules for GaLore/APOLLO optimizers, which are not built"),
    "eval_use_gather_object": ((False,), "predictions are gathered as tensors (padded across processes)"),
    "use_legacy_prediction_loop": ((False,), "the only prediction loop is evaluation_loop"),
    "save_safetensors": ((True,), "weights are always written as safetensors"),
    "tpu_metrics_debug": ((False,), "there is no TPU support"),
}
"""Fields not built yet: the values accepted, and what to do instead."""

_ACCEPTED_NOTES = {
    "enable_jit_checkpoint": "lockstep's Trainer always checkpoints and exits on SIGTERM/SIGUSR1 (preemption), "
    "whatever the value",
    "local_rank": "launchers set LOCAL_RANK; lockstep reads the environment and ignores the field",
    "do_train": "read by scripts only, as in transformers",
    "do_predict": "read by scripts only, as in transformers",
}

_IMPLEMENTED = (
    "output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type "
    "lr_scheduler_kwargs warmup_steps optim optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon "
    "gradient_accumulation_steps max_grad_norm label_smoothing_factor bf16 fp16 tf32 activation_checkpointing "
    "activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs torch_compile "
    "torch_compile_backend torch_compile_mode use_cache neftune_noise_alpha torch_empty_cache_steps "
    "logging_strategy logging_steps logging_first_step log_on_each_node logging_nan_inf_filter "
    "include_num_input_tokens_seen log_level log_level_replica disable_tqdm report_to run_name eval_strategy "
    "eval_steps eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start "
    "eval_accumulation_steps save_strategy save_steps save_total_limit load_best_model_at_end "
    "metric_for_best_model greater_is_better full_determinism seed data_seed use_cpu accelerator_config "
    "dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
    "dataloader_prefetch_factor dataloader_multiprocessing_context remove_unused_columns label_names "
    "ddp_find_unused_parameters ddp_bucket_cap_mb "
    "batch_eval_metrics include_for_metrics eval_do_concat_batches auto_find_batch_size save_only_model save_on_each_node restore_callback_states_from_checkpoint "
    "ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed do_eval "
    "parallelism_config average_tokens_across_devices train_sampling_strategy length_column_name "
    "resume_from_checkpoint"
).split()

LOCKSTEP_ONLY = {
    "overwrite_output_dir": "a transformers 4 field that its example scripts read (transformers 5 removed it)",
    "evaluation_strategy": "transformers 4's name of eval_strategy (removed in 4.46)",
    "use_legacy_prediction_loop": "a transformers 4 field (not built: True is refused)",
    "save_safetensors": "a transformers 4 field (not built: False is refused; weights are always safetensors)",
    "tpu_metrics_debug": "a transformers 4 field that its trainer_qa.py reads (not built: True is refused)",
    "logging_dir": "folder of the tracker files (transformers 5 removed it)",
    "warmup_ratio": "warm-up as a fraction (transformers 5 folded it into warmup_steps < 1)",
    "activation_checkpointing_policy": "what each layer keeps for backward (full, every_<k>, op, offload); a "
    "separate field because transformers passes gradient_checkpointing_kwargs on to torch's checkpoint",
    "elastic_keep_global_batch": "lockstep extension: keep the global batch when resuming on another number of "
    "processes, by changing gradient_accumulation_steps",
    "loss_type": "TRL's name (SFTConfig): 'chunked_nll' computes a causal LM's loss without the full logits "
    "(lockstep.layers.long_context)",
}


FIELD_STATUS: dict[str, tuple[str, str]] = {
    **{name: (IMPLEMENTED, "") for name in _IMPLEMENTED},
    **{name: (ACCEPTED, note) for name, note in _ACCEPTED_NOTES.items()},
    **{
        name: (NOT_BUILT, note)
        for name, (_, note) in _NOT_BUILT.items()
        if name not in _ACCEPTED_NOTES and name not in LOCKSTEP_ONLY
    },
}
"""transformers 5.24's ``TrainingArguments`` fields -> (status, note)."""


def add_on_fields() -> list[tuple[Any, str]]:
    """Each registered add-on and layer that names a ``TrainingArguments`` field (its spec's
    ``trainer_argument``, with an ``Accelerator`` keyword to pass it on), with the field's help.

    Example:
        >>> [spec.trainer_argument for spec, _ in add_on_fields()]
        ['fault_tolerance']
    """
    from lockstep.config.backend_specs import add_on_specs

    found = []
    for spec in add_on_specs():
        if spec.trainer_argument and spec.accelerator_argument:
            kind = (
                spec.plugin_type
                if isinstance(spec.plugin_type, str)
                else getattr(spec.plugin_type, "__name__", "")
            )
            keys = ", ".join(entry.key for entry in spec.keys)
            found.append(
                (
                    spec,
                    f"lockstep extension: {spec.summary or spec.name}. A dict (or JSON text) of the config file's "
                    f"{spec.config_section} keys ({keys}), or a {str(kind).rpartition(':')[2] or 'config object'}.",
                )
            )
    return found


def check_not_built(args: TrainingArguments) -> None:
    """Raise ``NotImplementedError`` for the first field set to a value lockstep does not build."""
    for name, (accepted, what_to_do) in _NOT_BUILT.items():
        value = getattr(args, name)
        if not any(value == ok and type(value) is type(ok) for ok in accepted):
            raise NotImplementedError(
                f"TrainingArguments({name}={value!r}) is not built in lockstep: {what_to_do}. Leave {name} at "
                f"{accepted[0]!r}."
            )
