"""What a transformers model needs to be traced and cut into pipeline stages, and the loss of a causal LM.

torch's tracer (``torch.distributed.pipelining.pipeline``, i.e. ``torch.export``) captures a transformers
decoder such as ``LlamaForCausalLM`` as it is (``attn_implementation="eager"`` or ``"sdpa"``), with three
conditions met here or refused with a clear error:

* **No KV cache.** A forward with ``use_cache=True`` builds a ``DynamicCache`` the tracer cannot capture;
  training never uses one, so ``config.use_cache`` is off while tracing and restored after.
* **No parameter shared across stages.** Tied weights (``tie_word_embeddings=True``: the input embedding is
  the LM head) would end up in the first and the last stage; torch's tracer silently gives each stage its
  own copy, so they would train apart and differ from one process. :func:`check_shared_parameters` refuses
  it, naming the option; untying silently would change the model being trained.
* **The loss outside the model.** A forward that computes the loss from ``labels`` does not trace (its
  data-dependent branches break the graph); the last stage returns the logits, and the loss is a function
  of them: :func:`causal_lm_loss` for a causal LM (the next-token cross-entropy, as the model's own loss).

The stages exchange the hidden states and what the decoder computes once for all layers (rotary
``cos``/``sin``, the attention mask); the last stage returns the logits tensor (not a ``ModelOutput``).

Example:
    >>> import torch
    >>> logits, labels = torch.zeros(1, 3, 5), torch.tensor([[1, 2, -100]])
    >>> round(float(causal_lm_loss(logits, labels)), 4)  # log(5): uniform over 5 tokens, one label counted
    1.6094
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

IGNORE_INDEX = -100
"""Labels with this value count towards no loss (padding), as in transformers."""


@contextlib.contextmanager
def tracing_options(model: nn.Module) -> Iterator[None]:
    """Switch off what the tracer cannot capture (a transformers model's KV cache) while tracing."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        if use_cache:
            config.use_cache = use_cache  # type: ignore[union-attr]


def check_shared_parameters(
    model: nn.Module, stage_modules: Sequence[nn.Module], split_points: list[str]
) -> None:
    """Raise a ``ValueError`` when one parameter of ``model`` (tied weights) falls in two stages."""
    names_by_parameter: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_parameter.setdefault(id(parameter), []).append(name)
    stage_names = [{name for name, _ in module.named_parameters()} for module in stage_modules]
    for names in names_by_parameter.values():
        if len(names) < 2:
            continue
        stages = sorted({index for index, held in enumerate(stage_names) for name in names if name in held})
        if len(stages) < 2:
            continue
        config = getattr(model, "config", None)
        tied = getattr(config, "tie_word_embeddings", False)
        hint = (
            f"Build the model untied: {type(config).__name__}(..., tie_word_embeddings=False)"
            if tied
            else "Untie them"
        )
        raise ValueError(
            f"Pipeline stages {stages} of {type(model).__name__} (split_points={split_points}) would share one "
            f"parameter, named {' and '.join(names)} (tied weights). A pipeline cannot share a parameter across "
            f"stages: torch's tracer gives each stage its own copy, and the copies would train apart. {hint}, "
            "or choose split points that keep every use of it in one stage."
        )


def causal_lm_loss(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of a causal LM's logits: the logits at position t against the label at
    t + 1, labels of -100 ignored, averaged over the counted labels (the model's own loss from ``labels``).

    ``outputs`` is the logits tensor the last stage returns (or a tuple/dict holding it first/as ``logits``).
    Use it as ``TorchPipelineParallelConfig(loss_fn=causal_lm_loss)``.
    """
    logits = _logits(outputs)
    shifted_logits, shifted_labels = logits[..., :-1, :], labels[..., 1:].to(logits.device)
    return functional.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]).float(),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(
        f"causal_lm_loss(outputs, labels) needs the logits: a tensor, a tuple holding them first or a dict "
        f"with 'logits'; got {type(outputs).__name__}."
    )
