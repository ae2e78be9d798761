"""Per-rank memory of a described model for every (strategy, dtype, number of processes) asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lockstep.errors import UsageError
from lockstep.memory.activation_meter import KeptEstimate
from lockstep.memory.estimate.formulas import (
    ACTIVATION_FORMULA,
    STRATEGIES,
    MeshLayout,
    RankMemory,
    activation_bytes,
    check_choices,
    expert_parallel_model_state_bytes,
    mesh_activation_bytes,
    mesh_model_state_bytes,
    model_state_bytes,
)
from lockstep.memory.estimate.model_source import ModelDescription


@dataclass(frozen=True)
class MemoryEstimate:
    """The model, the assumptions, and one :class:`RankMemory` per (strategy, dtype, processes)."""

    model: ModelDescription
    optimizer: str
    batch_size: int
    seq_len: int
    rows: list[RankMemory] = field(default_factory=list)
    policies: list[KeptEstimate] = field(default_factory=list)
    """Activations kept for backward per activation policy (a meta-device forward), when asked for."""

    def as_dict(self) -> dict[str, object]:
        shape = self.model.transformer
        return {
            "model": {
                "source": self.model.source,
                "class": self.model.model_class,
                "num_parameters": self.model.num_parameters,
                "trainable_parameters": self.model.trainable_parameters,
                "frozen_parameters": self.model.frozen_parameters,
                "adapters": self.model.adapters,
                "transformer_shape": None if shape is None else vars(shape),
            },
            "assumptions": {
                "optimizer": self.optimizer,
                "batch_size_per_process": self.batch_size,
                "seq_len": self.seq_len,
                "model_state": "ZeRO paper accounting; bf16/fp16 = mixed precision with fp32 master weights",
                "activations": ACTIVATION_FORMULA
                if shape
                else f"unknown: {self.model.unknown_activations_reason}",
            },
            "estimates": [row.as_dict() for row in self.rows],
            "activation_policies": [{**vars(kept), "on_device": kept.on_device} for kept in self.policies],
        }


def estimate_memory(
    model: ModelDescription,
    *,
    num_processes: Sequence[int] = (1, 2, 4, 8),
    dtypes: Sequence[str] = ("fp32", "bf16"),
    strategies: Sequence[str] = STRATEGIES,
    optimizer: str = "adamw",
    batch_size: int = 1,
    seq_len: int = 512,
    layout: MeshLayout | None = None,
    ep_size: int | None = None,
) -> MemoryEstimate:
    """Estimate the training memory each rank needs.

    Args:
        model: from :func:`lockstep.memory.estimate.describe_model`.
        num_processes: process counts to tabulate.
        dtypes: ``fp32`` (no mixed precision), ``bf16`` / ``fp16`` (mixed precision).
        strategies: any of ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp``.
        optimizer: ``adamw``, ``adam``, ``sgd-momentum`` or ``sgd``.
        batch_size: micro-batch size per process (activations).
        seq_len: sequence length (activations).
        layout: an N-D layout (tensor, context, sharded and replicated data parallel sizes); adds one
            ``mesh`` row per dtype (the model's own tensor-parallel plan says what TP splits).
        ep_size: expert parallelism over this many processes (``ParallelismConfig(ep_size=N)``); adds one
            ``ep`` row per dtype: each rank holds ``num_experts / ep_size`` experts of every block and the
            whole dense part. The model must have mixture-of-experts blocks whose experts ``ep_size`` divides.
            With a ``layout`` of ``dp_shard`` only (``ParallelismConfig(dp_shard_size=M, ep_size=N)``, ``N``
            dividing ``M``), the ``ep`` row is FSDP2 with expert parallelism: each rank holds ``1 / M`` of the
            dense part and its ``num_experts / ep_size`` experts sharded over their ``M / N`` replicas.

    Example:
        >>> from lockstep.memory.estimate import describe_model
        >>> estimate = estimate_memory(describe_model("BertConfig"), num_processes=[2], dtypes=["bf16"])
        >>> [row.model_state // estimate.model.num_parameters for row in estimate.rows]
        [16, 10, 9, 8, 8]
    """
    if batch_size < 1 or seq_len < 1:
        raise UsageError(f"batch size and sequence length must be >= 1, got {batch_size} and {seq_len}.")
    check_choices(dtypes=dtypes, strategies=strategies, optimizer=optimizer)
    if ep_size is not None:
        check_expert_parallel(model, ep_size)
        check_expert_parallel_layout(layout, ep_size)
    rows = []
    for dtype in dtypes:
        activations = None
        if model.transformer is not None:
            activations = activation_bytes(
                model.transformer, batch_size=batch_size, seq_len=seq_len, dtype=dtype
            )
        for strategy in strategies:
            for count in num_processes:
                params, grads, optim = model_state_bytes(
                    strategy,
                    dtype,
                    count,
                    trainable=model.trainable_parameters,
                    frozen=model.frozen_parameters,
                    optimizer=optimizer,
                )
                rows.append(RankMemory(strategy, dtype, count, params, grads, optim, activations))
        if ep_size is not None:
            state = expert_parallel_model_state_bytes(
                ep_size,
                dtype,
                trainable=model.trainable_parameters,
                frozen=model.frozen_parameters,
                experts=model.expert_parameters,
                optimizer=optimizer,
                dp_shard=None if layout is None else layout.dp_shard,
            )
            ep_layout = f"ep={ep_size}" if layout is None else f"{layout.name} x ep={ep_size}"
            processes = ep_size if layout is None else layout.num_processes
            rows.append(RankMemory("ep", dtype, processes, *state, activations, layout=ep_layout))
        if layout is not None:
            rows.append(
                _mesh_row(model, layout, dtype, optimizer=optimizer, batch_size=batch_size, seq_len=seq_len)
            )
    return MemoryEstimate(model=model, optimizer=optimizer, batch_size=batch_size, seq_len=seq_len, rows=rows)


def check_expert_parallel(model: ModelDescription, ep_size: int) -> None:
    """Raise UsageError unless expert parallelism over ``ep_size`` processes can shard ``model``'s experts."""
    passed = f"--ep-size {ep_size} (ep_size={ep_size})"
    if ep_size < 1:
        raise UsageError(f"{passed} is invalid: it must be >= 1.")
    if not model.num_experts:
        raise UsageError(
            f"{passed} asks for expert parallelism, but {model.model_class} from {model.source} has no "
            "mixture-of-experts block it recognises (a transformers 5 model whose config sets num_experts, "
            "num_local_experts or n_routed_experts: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3). Drop --ep-size for a dense model."
        )
    indivisible = sorted({count for count in model.num_experts if count % ep_size})
    if indivisible:
        raise UsageError(
            f"{passed} does not divide the {indivisible[0]} experts per block of {model.model_class}: each rank "
            f"holds num_experts / ep_size experts of every block, so num_experts % ep_size must be 0. Pass an "
            f"--ep-size that divides {indivisible[0]}."
        )


def check_expert_parallel_layout(layout: MeshLayout | None, ep_size: int) -> None:
    """Raise UsageError unless ``layout`` is one expert parallelism composes with: none (DDP) or ``dp_shard``
    alone with ``ep_size`` dividing it (FSDP2), as ``ParallelismConfig`` accepts."""
    if layout is None:
        return
    passed = f"--ep-size {ep_size} with {layout.name}"
    if (layout.tp, layout.cp, layout.dp_replicate) != (1, 1, 1):
        raise UsageError(
            f"{passed} is not built: expert parallelism composes with DDP or FSDP2 (--dp-shard) only, not with "
            "--tp, --cp or --dp-replicate. Drop them, or drop --ep-size for the mesh row alone."
        )
    if layout.dp_shard % ep_size:
        raise UsageError(
            f"{passed} is invalid: ep_size must divide dp_shard (the experts are sharded over dp_shard / ep_size "
            f"replicas). Pass a --dp-shard that is a multiple of {ep_size}."
        )


def _mesh_row(
    model: ModelDescription, layout: MeshLayout, dtype: str, *, optimizer: str, batch_size: int, seq_len: int
) -> RankMemory:
    params, grads, optim = mesh_model_state_bytes(
        layout,
        dtype,
        trainable=model.trainable_parameters,
        frozen=model.frozen_parameters,
        tensor_parallel=model.tensor_parallel_parameters,
        optimizer=optimizer,
    )
    activations = None
    if model.transformer is not None:
        activations = mesh_activation_bytes(
            model.transformer, layout, batch_size=batch_size, seq_len=seq_len, dtype=dtype
        )
    return RankMemory(
        "mesh", dtype, layout.num_processes, params, grads, optim, activations, layout=layout.name
    )
