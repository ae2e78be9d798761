"""The Trainer's words for the chunked loss: ``TrainingArguments(loss_type=...)``. Must not import torch."""

from __future__ import annotations

MODEL_LOSS, CHUNKED_NLL = "nll", "chunked_nll"
LOSS_TYPES = (MODEL_LOSS, CHUNKED_NLL)
"""``nll``: the model's own loss (the default; None means the same). ``chunked_nll`` (TRL's name): a causal
LM's loss computed chunk by chunk from its final hidden states, never building the full logits."""

LOSS_TYPE_HELP = (
    "The training loss: 'nll' (default; the model's own) or 'chunked_nll' (TRL's name: a causal LM's "
    "cross-entropy computed chunk by chunk from its final hidden states, never building tokens x vocab "
    "logits; lockstep.chunked_causal_lm_loss). One process, DDP and tensor parallelism (vocabulary-parallel)."
)


def check_loss_type(value: str | None) -> str:
    """The loss type ``value`` names (None -> ``"nll"``).

    Raises:
        ValueError: a name that is not one of :data:`LOSS_TYPES`.

    Example:
        >>> check_loss_type(None), check_loss_type("chunked_nll")
        ('nll', 'chunked_nll')
    """
    if value is None:
        return MODEL_LOSS
    if value not in LOSS_TYPES:
        raise ValueError(
            f"TrainingArguments(loss_type={value!r}) is invalid: it must be one of {', '.join(LOSS_TYPES)}. Pass "
            "'chunked_nll' for the loss that never builds the full logits, 'nll' for the model's own."
        )
    return value
