"""transformers' Trainer methods that report and write outside the training loop: metrics, state, model card.

Functions of the Trainer (``self``), bound in its class body as transformers binds ``log_metrics`` from
``trainer_pt_utils``; each writes on the job's first process only.

Example:
    >>> metrics = trainer.train().metrics  # doctest: +SKIP
    >>> trainer.log_metrics("train", metrics)  # doctest: +SKIP
    >>> trainer.save_metrics("train", metrics)  # train_results.json, all_results.json  # doctest: +SKIP
    >>> trainer.save_state()  # output_dir/trainer_state.json  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any, NoReturn

from lockstep.trainer import _output_dir, _transformers_format

# typed loosely: trainer.py binds these functions, so importing it here would be an import cycle
Trainer = Any

_NO_UPLOAD = (
    "lockstep does not upload to the Hugging Face Hub (it needs network access and huggingface_hub). Save with "
    "trainer.save_model() and trainer.create_model_card(), then upload output_dir yourself with "
    "huggingface_hub.upload_folder(repo_id=..., folder_path=args.output_dir)."
)


def is_world_process_zero(self: Trainer) -> bool:
    """Whether this is the job's first process (the one that writes)."""
    return self.accelerator.is_main_process


def is_local_process_zero(self: Trainer) -> bool:
    """Whether this is its machine's first process."""
    return self.accelerator.is_local_main_process


def save_processing_class(self: Trainer, folder: Path) -> None:
    """The tokenizer (or processor) into ``folder`` beside the model, as transformers saves it."""
    if self.processing_class is not None:
        self.processing_class.save_pretrained(str(folder))


def _seconds_text(seconds: float) -> str:
    fraction = int(abs(seconds - int(seconds)) * 100)
    return f"{datetime.timedelta(seconds=int(seconds))}.{fraction:02d}"


def metrics_format(metrics: dict[str, float]) -> dict[str, Any]:
    """``Trainer.metrics_format``: metrics formatted for reading, as transformers prints them (see there)."""
    formatted: dict[str, Any] = dict(metrics)
    for key, value in formatted.items():
        if "_mem_" in key:
            formatted[key] = f"{value >> 20}MB"
        elif "_runtime" in key:
            formatted[key] = _seconds_text(value)
        elif key == "total_flos":
            formatted[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            formatted[key] = round(value, 4)
    return formatted


def log_metrics(self: Trainer, split: str, metrics: dict[str, float]) -> None:
    """Print ``metrics`` as an aligned ``***** {split} metrics *****`` table (first process only)."""
    if not self.is_world_process_zero():
        return
    print(f"***** {split} metrics *****")
    formatted = self.metrics_format(metrics)
    key_width = max((len(str(key)) for key in formatted), default=0)
    value_width = max((len(str(value)) for value in formatted.values()), default=0)
    for key in sorted(formatted):
        print(f"  {key: <{key_width}} = {formatted[key]:>{value_width}}")


def save_metrics(self: Trainer, split: str, metrics: dict[str, float], combined: bool = True) -> None:
    """Write ``output_dir/{split}_results.json``; with ``combined`` also merge them into ``all_results.json``."""
    if not self.is_world_process_zero():
        return
    with _output_dir.writable(
        self.args.output_dir, fetch=("all_results.json",) if combined else ()
    ) as folder:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{split}_results.json").write_text(
            json.dumps(metrics, indent=4, sort_keys=True), encoding="utf-8"
        )
        if combined:
            path = folder / "all_results.json"
            merged = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            merged.update(metrics)
            path.write_text(json.dumps(merged, indent=4, sort_keys=True), encoding="utf-8")


def save_state(self: Trainer) -> None:
    """Write ``output_dir/trainer_state.json`` in transformers' format (``save_model`` writes only the model)."""
    if not self.is_world_process_zero():
        return
    with _output_dir.writable(self.args.output_dir) as folder:
        folder.mkdir(parents=True, exist_ok=True)
        _transformers_format.write_trainer_state(folder, self.state)


def push_to_hub(
    self: Trainer,
    commit_message: str | None = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    **kwargs: Any,
) -> NoReturn:
    """Refused: raises ``NotImplementedError`` (lockstep works offline; upload ``output_dir`` yourself)."""
    raise NotImplementedError(
        f"Trainer.push_to_hub(commit_message={commit_message!r}) is refused: {_NO_UPLOAD}"
    )


def init_hf_repo(self: Trainer, token: str | None = None, private: bool | None = None) -> NoReturn:
    """Refused: raises ``NotImplementedError`` (lockstep does not create Hub repositories)."""
    raise NotImplementedError(f"Trainer.init_hf_repo() is refused: {_NO_UPLOAD}")


def _listed(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def create_model_card(
    self: Trainer,
    language: str | None = None,
    license: str | None = None,  # transformers' parameter name
    tags: str | list[str] | None = None,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    tasks: str | list[str] | None = None,
    dataset_tags: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
    dataset_args: str | list[str] | None = None,
) -> None:
    """``Trainer.create_model_card``: write ``output_dir/README.md``, a model card (see there)."""
    if not self.is_world_process_zero():
        return
    name = model_name or Path(self.args.output_dir).name
    finetuned_from = (
        finetuned_from or getattr(getattr(self.model, "config", None), "_name_or_path", None) or None
    )
    header = {
        "library_name": "transformers",
        "language": _listed(language),
        "license": license,
        "base_model": finetuned_from,
        "tags": ["generated_from_trainer", *_listed(tags)],
        "datasets": _listed(dataset_tags) or _listed(dataset),
        "pipeline_tag": (_listed(tasks) or [None])[0],
    }
    lines = ["---", *_front_matter(header), "---", "", f"# {name}", ""]
    about = f"a fine-tuned version of [{finetuned_from}]" if finetuned_from else "trained from scratch"
    data = f" on the {', '.join(_listed(dataset))} dataset" if dataset else ""
    lines += [f"This model is {about}{data}, with lockstep's Trainer.", ""]
    lines += _results(self.state.log_history) + _hyperparameters(self) + _versions()
    with _output_dir.writable(self.args.output_dir) as folder:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _front_matter(header: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in header.items():
        if value in (None, []):
            continue
        if isinstance(value, list):
            lines += [f"{key}:", *(f"- {item}" for item in value)]
        else:
            lines.append(f"{key}: {value}")
    return lines


def _results(log_history: list[dict[str, Any]]) -> list[str]:
    evaluations = [entry for entry in log_history if any(key.startswith("eval_") for key in entry)]
    if not evaluations:
        return []
    last = evaluations[-1]
    lines = ["## Evaluation results", "", "| metric | value |", "|---|---|"]
    lines += [f"| {key} | {value:.4g} |" for key, value in last.items() if key.startswith("eval_")]
    lines += [f"| epoch | {last.get('epoch', '-')} |", f"| step | {last.get('step', '-')} |", ""]
    return lines


def _hyperparameters(self: Trainer) -> list[str]:
    args = self.args
    values = {
        "learning_rate": args.learning_rate,
        "train_batch_size": args.per_device_train_batch_size,
        "eval_batch_size": args.per_device_eval_batch_size,
        "seed": args.seed,
        "num_processes": self.accelerator.num_processes,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optimizer": f"{args.optim} (betas=({args.adam_beta1}, {args.adam_beta2}), epsilon={args.adam_epsilon})",
        "lr_scheduler_type": args.lr_scheduler_type,
        "num_epochs": args.num_train_epochs,
    }
    if args.max_steps > 0:
        values["training_steps"] = args.max_steps
    lines = ["## Training hyperparameters", ""]
    return lines + [f"- {key}: {value}" for key, value in values.items()] + [""]


def _versions() -> list[str]:
    import torch

    from lockstep._version import __version__

    lines = [
        "## Framework versions",
        "",
        f"- lockstep {__version__}",
        f"- PyTorch {torch.__version__}",
    ]
    return [*lines, f"- Python {platform.python_version()}"]
