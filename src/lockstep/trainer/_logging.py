"""The Trainer's one-line log messages, e.g. ``[train] epoch 1/1 step 1/144 loss 1.795169 lr 2.99e-05``."""

from __future__ import annotations

from typing import Any

_TIMING_KEYS = ("runtime", "samples_per_second", "steps_per_second")


def _value(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _position(epoch: int, num_epochs: int, step: int, max_steps: int) -> str:
    if max_steps <= 0:
        return ""
    return f" epoch {epoch}/{num_epochs} step {step}/{max_steps}"


def format_log_line(logs: dict[str, Any], *, epoch: int, num_epochs: int, step: int, max_steps: int) -> str:
    """One line for a ``Trainer.log`` call: training loss, evaluation metrics, or the end-of-run summary."""
    where = _position(epoch, num_epochs, step, max_steps)
    if "loss" in logs and "learning_rate" in logs:
        return f"[train]{where} loss {logs['loss']:.6f} lr {logs['learning_rate']:.2e}"
    if "train_loss" in logs:
        return (
            f"[train] done: {step} steps in {logs.get('train_runtime', 0.0):.1f} s "
            f"({logs.get('train_samples_per_second', 0.0):.1f} samples/s), mean loss {logs['train_loss']:.6f}"
        )
    prefixes = sorted({key.split("_", 1)[0] for key in logs if "_" in key} & {"eval", "test"})
    if prefixes:
        prefix = prefixes[0]
        metrics = {
            key[len(prefix) + 1 :]: value
            for key, value in logs.items()
            if key.startswith(f"{prefix}_") and key[len(prefix) + 1 :] not in _TIMING_KEYS
        }
        ordered = sorted(metrics, key=lambda name: (name != "loss", name))
        text = " ".join(f"{name} {_value(metrics[name])}" for name in ordered)
        return f"[{prefix}]{where} {text}".rstrip()
    text = " ".join(f"{key} {_value(value)}" for key, value in logs.items() if key != "epoch")
    return f"[log]{where} {text}".rstrip()
