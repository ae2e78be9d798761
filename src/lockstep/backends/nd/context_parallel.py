"""Context parallelism: torch's ring attention over the ``cp`` mesh, on GPUs and on CPUs.

``torch.distributed.tensor.experimental.context_parallel`` splits the batch tensors along the sequence
(each ``cp`` rank keeps a head chunk and a tail chunk, so that causal attention costs every rank the same)
and, while its block runs, replaces ``F.scaled_dot_product_attention`` with a version that makes q, k and v
sequence-sharded DTensors. DTensor then hands the attention kernel to torch's ring attention
(``_templated_ring_attention`` and ``_templated_ring_attention_backward``), which passes keys and values
between the ``cp`` ranks (one all-gather, or an all-to-all per step: ``cp_comm_strategy``) and merges the
partial results by their log-sum-exp.

Why this module exists: torch 2.13 maps only the CUDA kernels to the ring (flash, efficient and cuDNN
attention, in the ``custom_ops`` table of ``torch/distributed/tensor/experimental/_context_parallel/
_attention.py``). On a CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward, which DTensor refuses ("does not have a sharding strategy registered"), although the ring is
generic over the kernel: the CPU flash kernel returns the output and the log-sum-exp the ring merges, as
the CUDA one does. :func:`register_cpu_ring_attention` adds the two CPU kernels to torch's table, each
calling torch's own ring functions with the CPU kernel; the collectives and the attention arithmetic are
torch's. The names used are private, so they are checked first and a torch without them gets an error
naming its version.

:func:`context_parallel_region` wraps torch's context manager with the checks its ring needs, which torch
leaves to a late or cryptic failure: buffers whose sequence splits evenly into ``2 * cp_size`` chunks (else
torch silently drops the load balancing, or fails in the ring), SDPA calls that are causal, unmasked and
without dropout, and at least one such call in the block (a model whose attention is not SDPA would
otherwise attend only to its own shard and train on wrong values without any error).

Example:
    >>> with context_parallel_region(cp_mesh, buffers=[ids, labels, positions],
    ...                              buffer_seq_dims=[1, 1, 1], comm_strategy="allgather"):  # doctest: +SKIP
    ...     loss = loss_fn(model(ids, position_ids=positions), labels)
    ...     accelerator.backward(loss)
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

_SEQ_DIM = 2
"""The sequence dimension of q, k and v inside SDPA (batch, heads, sequence, head_dim)."""
_TORCH_NAMES = ("context_parallel", "set_rotate_method", "custom_ops")
_RING_PARAMETERS = {
    "_templated_ring_attention": ("group", "seq_dim", "op", "query", "key", "value", "is_causal"),
    "_templated_ring_attention_backward": (
        "group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out", "logsumexp",
        "is_causal",
    ),
}  # fmt: skip
"""torch's ring functions and the parameters this module passes them (torch 2.13's signatures)."""
_registered = False
_WHOLE_RESTARTS: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
    "lockstep_cp_whole_restarts", default=None
)
"""Inside a context-parallel block: for each 2-D integer buffer (by ``id``), whether its values restart
within a row before the split (packed documents, read by ``lockstep.layers.long_context``)."""


def _torch_ring_attention() -> ModuleType:
    """torch's context-parallel attention module, checked for the private names this module relies on."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError as error:
        raise RuntimeError(
            f"Context parallelism uses torch's ring attention (torch.distributed.tensor.experimental."
            f"_context_parallel._attention), which cannot be imported from torch {torch.__version__}: {error}. "
            "lockstep's context parallelism is built against torch 2.13; use it, or set cp_size=1."
        ) from error
    missing = [name for name in _TORCH_NAMES if not hasattr(_attention, name)]
    for name, expected in _RING_PARAMETERS.items():
        ring = getattr(_attention, name, None)
        if ring is None or tuple(inspect.signature(ring).parameters)[: len(expected)] != expected:
            missing.append(f"{name}({', '.join(expected)}, ...)")
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        missing.append("aten._scaled_dot_product_flash_attention_for_cpu_backward")
    if missing:
        raise RuntimeError(
            f"Context parallelism uses torch's ring attention, but torch {torch.__version__} lacks "
            f"{', '.join(missing)} (torch.distributed.tensor.experimental._context_parallel._attention): "
            "these private names changed. lockstep's context parallelism is built against torch 2.13; use it, "
            "or set cp_size=1."
        )
    return _attention


# -- the CPU kernels, handed to torch's ring ---------------------------------------------------------------
def _arguments(
    op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name (the kernel's schema), defaults included."""
    bound = {a.name: a.default_value for a in op_call._schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in op_call._schema.arguments), args))
    bound.update(kwargs)
    return bound


def _local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sequence_sharded(tensors: Sequence[torch.Tensor], mesh: DeviceMesh) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in tensors)


def _refuse_mask(arguments: dict[str, Any]) -> None:
    if arguments.get("attn_mask") is not None:
        raise NotImplementedError(
            "Context parallelism got an attention mask: torch's ring attention splits the sequence over the cp "
            "ranks and honours only causal masking (is_causal=True). Drop the mask, or set cp_size=1."
        )


def _on_ring(
    arguments: dict[str, Any],
    ring: Callable[..., tuple[Any, ...]],
    kernel: torch._ops.OpOverload,
    tensors: tuple[str, ...],
    **extra: Any,
) -> tuple[Any, ...]:
    """A call on sequence-sharded DTensors (its ``arguments`` by name), run by torch's ``ring`` function with
    ``kernel`` on the local parts of its ``tensors`` (``extra`` passed as given); the results sharded again."""
    _refuse_mask(arguments)
    mesh = arguments["query"].device_mesh
    results = ring(
        mesh.get_group(),
        _SEQ_DIM,
        kernel,
        **{name: _local(arguments[name]) for name in tensors},
        is_causal=arguments["is_causal"],
        dropout_p=arguments["dropout_p"],
        scale=arguments["scale"],
        **extra,
    )
    return _sequence_sharded(results, mesh)


def _ring_flash_attention_for_cpu(
    op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` on sequence-sharded DTensors: torch's ring."""
    return _on_ring(
        _arguments(op_call, args, kwargs),
        _torch_ring_attention()._templated_ring_attention,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        ("query", "key", "value"),
    )


def _ring_flash_attention_for_cpu_backward(
    op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` on sequence-sharded DTensors."""
    return _on_ring(
        _arguments(op_call, args, kwargs),
        _torch_ring_attention()._templated_ring_attention_backward,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        ("grad_out", "query", "key", "value", "out", "logsumexp"),
        grad_out_name="grad_out",
    )


def register_cpu_ring_attention() -> None:
    """Add the CPU flash-attention kernels to torch's context-parallel kernel table (once per process).

    torch's ``context_parallel`` installs that table into DTensor's dispatcher on entry and removes it on
    exit, so outside a context-parallel block nothing changes.
    """
    global _registered
    if _registered:
        return
    attention = _torch_ring_attention()
    aten = torch.ops.aten
    attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = (
        _ring_flash_attention_for_cpu
    )
    attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = (
        _ring_flash_attention_for_cpu_backward
    )
    _registered = True


# -- the block -------------------------------------------------------------------------------------------
def _check_buffers(
    cp_size: int,
    buffers: Sequence[torch.Tensor] | None,
    buffer_seq_dims: Sequence[int] | None,
) -> None:
    if not buffers:
        raise ValueError(
            f"maybe_context_parallel(buffers={buffers!r}): with cp_size={cp_size} the batch is split along the "
            "sequence, so the block needs the tensors to split. Pass buffers=[input_ids, labels, position_ids] "
            "and buffer_seq_dims=[1, 1, 1] (labels shifted already, position_ids of the whole sequence)."
        )
    if buffer_seq_dims is None or len(buffer_seq_dims) != len(buffers):
        raise ValueError(
            f"maybe_context_parallel(buffer_seq_dims={buffer_seq_dims!r}) must give the sequence dimension of "
            f"each of the {len(buffers)} buffers, in the same order."
        )
    for buffer in buffers:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(
                f"maybe_context_parallel(buffers=...) takes tensors; got a {type(buffer).__name__}. Pass the "
                "batch's tensors (input_ids, labels, position_ids)."
            )
    lengths = [buffer.shape[dim] for buffer, dim in zip(buffers, buffer_seq_dims, strict=True)]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"maybe_context_parallel(): the buffers have sequence lengths {lengths} along buffer_seq_dims="
            f"{list(buffer_seq_dims)}; they must be equal (every buffer is split at the same positions)."
        )
    if lengths[0] % (2 * cp_size):
        raise ValueError(
            f"maybe_context_parallel(): a sequence of {lengths[0]} tokens cannot be split over cp_size={cp_size}: "
            f"each rank holds two chunks (a head and a tail, which balances causal attention), so the length must "
            f"be a multiple of 2 * cp_size = {2 * cp_size}. Pad or pack the batch to such a length."
        )


def _checked_call(attn_mask: Any, dropout_p: float, is_causal: bool) -> None:
    where = "The model called F.scaled_dot_product_attention inside maybe_context_parallel() with"
    if attn_mask is not None:
        raise NotImplementedError(
            f"{where} an attn_mask of shape {tuple(attn_mask.shape)}: torch's ring attention splits the sequence "
            "over the cp ranks and honours only causal masking (is_causal=True, no mask). Drop the "
            "attention_mask (pack the sequences to full length), or set cp_size=1."
        )
    if dropout_p:
        raise NotImplementedError(
            f"{where} dropout_p={dropout_p}: the ring computes attention block by block and cannot apply "
            "attention dropout. Set the model's attention dropout to 0 (transformers: attention_dropout=0.0), "
            "or set cp_size=1."
        )
    if not is_causal:
        raise NotImplementedError(
            f"{where} is_causal=False: the sequence is split into balanced head and tail chunks, which "
            "torch's ring attention supports for causal attention only. Use causal attention, or set cp_size=1."
        )


@contextlib.contextmanager
def _checked_attention(calls: list[int]) -> Iterator[None]:
    """Check and count every SDPA call (in front of torch's context-parallel version) while the block runs."""
    ring_version = F.scaled_dot_product_attention

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        _checked_call(attn_mask, dropout_p, is_causal)
        calls.append(1)
        return ring_version(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        # before torch's exit, which restores the original only if it finds its own version in place
        F.scaled_dot_product_attention = ring_version


@contextlib.contextmanager
def context_parallel_region(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None,
    buffer_seq_dims: Sequence[int] | None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    comm_strategy: str = "allgather",
) -> Iterator[None]:
    """Split ``buffers`` along their sequence over ``mesh`` and run SDPA as torch's ring attention.

    Args:
        mesh: the 1-D ``cp`` mesh.
        buffers: the batch tensors to split in place (restored on exit unless in ``no_restore_buffers``).
        buffer_seq_dims: the sequence dimension of each buffer.
        no_restore_buffers: buffers left split after the block.
        comm_strategy: ``"allgather"`` or ``"alltoall"``: how keys and values go round the ring.

    Raises:
        ValueError: buffers that cannot be split evenly into ``2 * cp_size`` chunks.
        NotImplementedError: an SDPA call with a mask, dropout or without causal masking.
        RuntimeError: a block that ran no SDPA (attention computed another way sees one shard only).
    """
    attention = _torch_ring_attention()
    _check_buffers(mesh.size(), buffers, buffer_seq_dims)
    assert buffers is not None and buffer_seq_dims is not None
    if mesh.device_type == "cpu":
        register_cpu_ring_attention()
    attention.set_rotate_method(comm_strategy)
    calls: list[int] = []
    # recorded before the split (in place), so that a packed batch is seen whole, alike on every cp rank
    token = _WHOLE_RESTARTS.set({id(b): _restarts(b) for b in buffers if _is_index(b)})
    try:
        with attention.context_parallel(
            mesh,
            buffers=list(buffers),
            buffer_seq_dims=list(buffer_seq_dims),
            no_restore_buffers=set(no_restore_buffers or ()),
        ):
            with _checked_attention(calls):
                yield
    finally:
        _WHOLE_RESTARTS.reset(token)
    if not calls:
        raise RuntimeError(
            "maybe_context_parallel(): the block ran no F.scaled_dot_product_attention, so the model computes "
            "attention another way (eager attention, a fused kernel, or SDPA bound to a name imported before the "
            "block, which the block cannot replace) and each cp rank attended only to its own shard of the "
            "sequence: its outputs and gradients are wrong. Call torch.nn.functional.scaled_dot_product_attention "
            "(transformers: attn_implementation='sdpa'), or set cp_size=1."
        )


def _is_index(buffer: torch.Tensor) -> bool:
    return buffer.dim() == 2 and not buffer.is_floating_point() and buffer.dtype != torch.bool


def _restarts(buffer: torch.Tensor) -> torch.Tensor:
    """Whether a row of ``buffer`` steps by anything but +1 (position_ids of packed documents): a 0-D bool
    tensor, read (synchronised) only for the buffer that reaches the model as ``position_ids``."""
    return (torch.diff(buffer, dim=1) != 1).any()


def whole_sequence_restarts(tensor: torch.Tensor) -> bool | None:
    """Inside a context-parallel block: whether ``tensor``, one of its buffers, restarted within a row before
    the split (the same answer on every cp rank); None outside a block or for a tensor that is no buffer."""
    restarts = _WHOLE_RESTARTS.get()
    flag = None if restarts is None else restarts.get(id(tensor))
    return None if flag is None else bool(flag)


def in_context_parallel_block() -> bool:
    """Whether a context-parallel block (:func:`context_parallel_region`) is running."""
    return _WHOLE_RESTARTS.get() is not None


def check_sdpa_attention(model: nn.Module, cp_size: int) -> None:
    """Refuse, at ``prepare``, a transformers model whose attention is not SDPA (it would ignore the ring)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation is not None and implementation != "sdpa":
        raise ValueError(
            f"ParallelismConfig(cp_size={cp_size}) needs SDPA attention, but {type(model).__name__} uses "
            f"attn_implementation={implementation!r}: context parallelism runs torch's ring attention in place of "
            "F.scaled_dot_product_attention only. Load the model with attn_implementation='sdpa', or set "
            "cp_size=1."
        )
