"""Packed documents kept apart: a block-causal mask from ``position_ids`` (or ``cu_seq_lens_q``).

Packing (transformers' ``DataCollatorWithFlattening``) puts several documents in one row, ``position_ids``
restarting at 0 for each, and no ``attention_mask``. Only transformers' flash-attention path reads the
boundaries from those. Its SDPA and eager paths do too, but only without a cache: a config with
``use_cache=True`` (Llama's default) makes the model build a ``DynamicCache`` in training as well, the
packed-sequence detection of ``masking_utils`` is then skipped, and every document attends to the ones before
it in the row (measured on the tiny Llama, two 32-token documents: document 2's loss 2.6e-3 away from document
2 alone, 3.4e-4 moved by one token of document 1).

:func:`keep_documents_apart` (applied by ``Accelerator.prepare`` to every transformers model) adds a forward
pre-hook: when a forward gets ``position_ids`` that restart inside a row (or ``cu_seq_lens_q``) and no
attention mask (or one of ones), it passes the block-causal mask as a 4-D ``attention_mask`` (token ``i``
attends to ``j`` iff both are in the same document and ``j <= i``), which transformers hands to attention as
it is. Forwards of unpacked batches are not touched (same inputs, same results, bit for bit).

Under context parallelism the sequence is split over the ``cp`` ranks and torch's ring attention honours
causal masking only, so a packed batch is refused by name at the first forward of the block, before any
attention collective: the check reads the whole ``position_ids`` as they were before the split (recorded by
``context_parallel_region``), so every ``cp`` rank raises together.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

_MASKED_HERE = ("sdpa", "eager")
"""Attention implementations that take the 4-D mask this module builds (bool for SDPA, additive for eager)."""
_READ_POSITIONS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")
"""Attention implementations that read document boundaries from ``position_ids`` themselves."""
_hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def document_ids(
    position_ids: torch.Tensor | None, cu_seq_lens: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The document of each token, ``(batch, sequence)`` (0, 1, ... within each row), or None when every row
    holds one document.

    Args:
        position_ids: ``(batch, sequence)`` positions; a new document starts wherever a position is not the
            previous one plus 1 (as transformers' ``find_packed_sequence_indices``).
        cu_seq_lens: the documents' cumulative lengths over a single row (``DataCollatorWithFlattening(
            return_flash_attn_kwargs=True)``'s ``cu_seq_lens_q``); read in place of ``position_ids`` when given
            (the prepared model's hook passes it only when a forward has no ``position_ids``).

    Example:
        >>> document_ids(torch.tensor([[0, 1, 2, 0, 1]])).tolist()
        [[0, 0, 0, 1, 1]]
    """
    if cu_seq_lens is not None:
        length = int(cu_seq_lens[-1])
        tokens = torch.arange(length, device=cu_seq_lens.device)
        ids = torch.bucketize(tokens, cu_seq_lens[1:-1].to(tokens.dtype), right=True)[None]
    elif position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    else:
        first = position_ids[:, :1] - 1
        ids = (torch.diff(position_ids, prepend=first, dim=1) != 1).cumsum(dim=1)
    return ids if bool((ids[:, -1] > 0).any()) else None


def block_causal_mask(documents: torch.Tensor, *, additive: bool = False) -> torch.Tensor:
    """The ``(batch, 1, sequence, sequence)`` mask in which token ``i`` sees ``j`` iff same document and ``j <= i``.

    Args:
        documents: :func:`document_ids`' ``(batch, sequence)`` tensor.
        additive: a float32 mask (0 where seen, the float32 minimum elsewhere: eager attention adds it to the
            scores) instead of a boolean one (True where seen: what SDPA takes).

    Example:
        >>> block_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    seen = (documents[:, :, None] == documents[:, None, :]) & causal
    seen = seen[:, None]
    if not additive:
        return seen
    return torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill(
        ~seen, torch.finfo(torch.float32).min
    )


def _name(model: nn.Module) -> str:
    """The model's own class name (FSDP2's ``fully_shard`` makes a subclass ``FSDP<name>``)."""
    return next(cls.__name__ for cls in type(model).__mro__ if not cls.__name__.startswith("FSDP"))


def _ones_or_none(mask: Any) -> bool:
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all()))


def _refuse_under_context_parallel(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Inside a context-parallel block: refuse packed documents, judged on the whole batch (every rank alike)."""
    from lockstep.backends.nd.context_parallel import whole_sequence_restarts

    name = _name(model)
    cu_keys = sorted(key for key in kwargs if key.startswith("cu_seq_lens") and kwargs[key] is not None)
    positions = kwargs.get("position_ids")
    packed = isinstance(positions, torch.Tensor) and whole_sequence_restarts(positions)
    if not cu_keys and not packed:
        return
    passed = (
        f"{' and '.join(cu_keys)}" if cu_keys else "position_ids that restart inside a row (packed documents)"
    )
    raise NotImplementedError(
        f"ParallelismConfig(cp_size > 1): {name} got {passed} inside maybe_context_parallel(). Context "
        "parallelism splits each row over the cp ranks and torch's ring attention honours causal masking only "
        "(is_causal=True), so every document would attend to the documents packed before it in the row and "
        "train on wrong values. Feed one document per row (pad or truncate to a multiple of 2 * cp_size, no "
        "DataCollatorWithFlattening), or train packed batches with cp_size=1 (lockstep then keeps the "
        "documents apart with a block-causal mask)."
    )


def _pre_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from lockstep.backends.nd.context_parallel import in_context_parallel_block

    if in_context_parallel_block():
        _refuse_under_context_parallel(model, kwargs)
        return None  # the split positions jump between chunks by design: never a mask from them
    positions, cu_seq_lens = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if (positions is None and cu_seq_lens is None) or kwargs.get("past_key_values") is not None:
        return None  # nothing to read documents from (no device sync), or generation with a cache
    documents = document_ids(positions, cu_seq_lens if positions is None else None)
    if documents is None or not _ones_or_none(kwargs.get("attention_mask")):
        return None  # one document per row, or the caller's own (padding or 4-D) mask: left as given
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation in _READ_POSITIONS:
        return None
    if implementation not in _MASKED_HERE:
        raise NotImplementedError(
            f"{_name(model)} got a packed batch (position_ids that restart inside a row, or "
            f"cu_seq_lens_q) and uses attn_implementation={implementation!r}, which lockstep cannot give a "
            "block-causal mask: its documents would attend to each other. Load the model with "
            "attn_implementation='sdpa', 'eager' or 'flash_attention_2', or feed one document per row."
        )
    mask = block_causal_mask(documents, additive=implementation == "eager")
    return args, {**kwargs, "attention_mask": mask}


def keep_documents_apart(model: nn.Module) -> nn.Module:
    """Make ``model`` (a transformers model) keep packed documents apart; once per model, returns it.

    A forward pre-hook turns the document boundaries of a packed batch (``position_ids`` restarting inside a
    row, or ``cu_seq_lens_q``, without an attention mask) into a block-causal 4-D ``attention_mask`` for SDPA
    and eager attention, refuses them under context parallelism, and leaves every other forward as it is.
    ``Accelerator.prepare`` applies it; a model without a transformers ``config`` is returned untouched.

    Example:
        >>> model = keep_documents_apart(model)  # doctest: +SKIP
        >>> model(input_ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))  # doctest: +SKIP
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation") or model in _hooked:
        return model
    model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    _hooked.add(model)
    return model
