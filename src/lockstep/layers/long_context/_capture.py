"""The hidden states a model's ``lm_head`` receives, taken during its forward that projects one position.

The chunked loss needs the final hidden states and the ``lm_head`` weight. Calling the base model
(``model.model(...)``) instead of the whole model would skip what wraps it (DDP prepares its gradient
synchronisation in its own forward), so the whole model is called and a forward pre-hook on ``lm_head`` keeps
its input and hands it the last position only (as ``generate``'s ``logits_to_keep=1``): the model's logits are
``batch x vocab`` floats. (An empty slice would be cheaper, but tensor parallelism's DTensor views of an empty
tensor fail: "integer modulo by zero".)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class LMHeadInput:
    """What :func:`skip_lm_head` saw: the input of ``lm_head`` in the forward it was active for."""

    def __init__(self) -> None:
        self._hidden_states: torch.Tensor | None = None

    @property
    def hidden_states(self) -> torch.Tensor:
        """The hidden states ``lm_head`` was called on (every position the model projects).

        Raises:
            RuntimeError: ``lm_head`` was not called inside the ``with`` block.
        """
        if self._hidden_states is None:
            raise RuntimeError(
                "skip_lm_head: lm_head was not called in the with block; call the model inside it, then read "
                "hidden_states."
            )
        return self._hidden_states

    def _record(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"skip_lm_head: {type(module).__name__} was called without a tensor as its first argument; it "
                "needs lm_head(hidden_states)."
            )
        if self._hidden_states is not None:
            raise RuntimeError(
                "skip_lm_head: lm_head was called twice in one with block; call the model once per block."
            )
        self._hidden_states = args[0]


@contextlib.contextmanager
def skip_lm_head(lm_head: nn.Module, *, keep_logits: bool = False) -> Iterator[LMHeadInput]:
    """Keep the input of ``lm_head`` during the ``with`` block, and let it project the last position only.

    The model's logits come out with a sequence length of 1 (``(batch, 1, vocab)``, the last position's); its
    loss is then not asked for (do not pass ``labels``). With ``keep_logits`` the input is kept and the logits
    are built as usual.

    Args:
        lm_head: the model's output projection (``unwrapped_model.lm_head``; for a prepared model, the module
            inside the wrapper: ``accelerator.unwrap_model(model).lm_head``).
        keep_logits: project every position anyway (evaluation that reads the logits).

    Example:
        >>> import torch
        >>> head = torch.nn.Linear(4, 10)
        >>> with skip_lm_head(head) as seen:
        ...     logits = head(torch.randn(2, 3, 4))
        >>> tuple(logits.shape), tuple(seen.hidden_states.shape)
        ((2, 1, 10), (2, 3, 4))
    """
    seen = LMHeadInput()

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        seen._record(module, args)
        if keep_logits:
            return None
        return (args[0][..., -1:, :], *args[1:])

    handle = lm_head.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()
