"""Per-rank training memory by the ZeRO paper's accounting, and an activation estimate for transformers.

Model state per trainable parameter (Rajbhandari et al., "ZeRO", 2020, section 3.1), with N processes:

=========  ==========  =========  ================  ======================
strategy   parameters  gradients  optimizer state   mixed precision + Adam
=========  ==========  =========  ================  ======================
ddp        P           G          K                 2 + 2 + 12 = 16
zero1      P           G          K / N             4 + 12/N
zero2      P           G / N      K / N             2 + 14/N
zero3      P / N       G / N      K / N             16/N
fsdp       P / N       G / N      K / N             16/N (FULL_SHARD = ZeRO-3)
=========  ==========  =========  ================  ======================

Mixed precision (bf16/fp16): P = G = 2 bytes, and K = 4 (fp32 master weights) + the optimizer's fp32 state
(Adam: 8). In fp32: P = G = 4 and K = the optimizer's state (Adam: 8), so still 16 bytes with Adam.
Frozen parameters hold only P (sharded under zero3/fsdp).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lockstep.errors import UsageError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
"""Ways of distributing training, in the order the table shows them."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}
"""fp32 bytes of optimizer state per trainable parameter (Adam: two moments; SGD: momentum buffer)."""

_SHARDED = {  # strategy -> (parameters sharded, gradients sharded, optimizer state sharded)
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp": (True, True, True),
}


@dataclass(frozen=True)
class TransformerShape:
    """What the activation formula needs from a transformer's config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int | None


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for one (strategy, dtype, number of processes); activations None if unknown."""

    strategy: str
    dtype: str
    num_processes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int | None
    layout: str | None = None
    """For the ``mesh`` strategy: the N-D layout, e.g. ``dp_shard=2 x tp=2``."""

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int | None:
        return None if self.activations is None else self.model_state + self.activations

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "model_state": self.model_state, "total": self.total}


def check_choices(
    *, dtypes: Sequence[str] = (), strategies: Sequence[str] = (), optimizer: str = "adamw"
) -> None:
    """Raise UsageError naming the first unknown dtype, strategy or optimizer."""
    for kind, values, known in (
        ("dtype", dtypes, DTYPE_BYTES),
        ("strategy", strategies, _SHARDED),
        ("optimizer", [optimizer], OPTIMIZER_STATE_BYTES),
    ):
        for value in values:
            if value not in known:
                raise UsageError(f"{kind} {value!r} is not known: use one of {', '.join(known)}.")


def bytes_per_parameter(dtype: str, optimizer: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per trainable parameter, before sharding."""
    check_choices(dtypes=[dtype], optimizer=optimizer)
    width = DTYPE_BYTES[dtype]
    master_weights = 4 if width < 4 else 0  # mixed precision keeps an fp32 copy for the optimizer
    return width, width, OPTIMIZER_STATE_BYTES[optimizer] + master_weights


def model_state_bytes(
    strategy: str,
    dtype: str,
    num_processes: int,
    *,
    trainable: int,
    frozen: int = 0,
    optimizer: str = "adamw",
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per rank. Shards are rounded up, as real shards are."""
    check_choices(strategies=[strategy])
    if num_processes < 1:
        raise UsageError(f"the number of processes must be >= 1, got {num_processes}.")
    param, grad, optim = bytes_per_parameter(dtype, optimizer)
    shard_params, shard_grads, shard_optim = _SHARDED[strategy]

    def share(total: int, sharded: bool) -> int:
        return -(-total // num_processes) if sharded else total

    return (
        share((trainable + frozen) * param, shard_params),
        share(trainable * grad, shard_grads),
        share(trainable * optim, shard_optim),
    )


@dataclass(frozen=True)
class MeshLayout:
    """An N-D layout (``ParallelismConfig``): tensor, context, sharded and replicated data parallel sizes."""

    tp: int = 1
    cp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1

    @property
    def num_processes(self) -> int:
        return self.tp * self.cp * self.dp_shard * self.dp_replicate

    @property
    def name(self) -> str:
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}
        return " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "one process"


def mesh_model_state_bytes(
    layout: MeshLayout,
    dtype: str,
    *,
    trainable: int,
    frozen: int = 0,
    tensor_parallel: int = 0,
    optimizer: str = "adamw",
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per rank of an N-D layout, as lockstep builds it:
    tensor parallelism splits the ``tensor_parallel`` elements over ``tp`` (the rest is replicated on the TP
    mesh), then FSDP shards everything over ``dp_shard x cp``; ``dp_replicate`` holds whole copies.

    Example:
        >>> mesh_model_state_bytes(MeshLayout(tp=2, dp_shard=2), "fp32", trainable=1000, tensor_parallel=800)
        (1200, 1200, 2400)
    """
    param, grad, optim = bytes_per_parameter(dtype, optimizer)
    total = trainable + frozen
    split = min(tensor_parallel, total)
    local = split / layout.tp + (total - split)  # elements this TP rank holds, before FSDP
    sharded = local / (layout.dp_shard * layout.cp)
    trained = sharded * (trainable / total if total else 1.0)
    return math.ceil(sharded * param), math.ceil(trained * grad), math.ceil(trained * optim)


def expert_parallel_model_state_bytes(
    ep_size: int,
    dtype: str,
    *,
    trainable: int,
    frozen: int = 0,
    experts: int,
    optimizer: str = "adamw",
    dp_shard: int | None = None,
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per rank of expert parallelism as lockstep builds it.

    Under DDP (``ParallelismConfig(ep_size=N)``, ``dp_shard`` None): the ``experts`` elements of the
    mixture-of-experts blocks are split over ``ep_size`` ranks (each holds ``num_experts / ep_size`` experts of
    every block, their gradients and optimizer state), everything else is replicated whole. The same on every
    rank whatever the number of data-parallel processes that ``ep_size`` divides (a larger one replicates each
    shard over the ep groups, and no rank holds more).

    Under FSDP2 (``ParallelismConfig(dp_shard_size=dp_shard, ep_size=N)``, ``N`` dividing ``dp_shard``): the
    dense part is sharded over all ``dp_shard`` ranks, and each rank's ``num_experts / ep_size`` experts over the
    ``dp_shard / ep_size`` ranks that hold the same experts (its replica group): ``1 / dp_shard`` of each part,
    each shard rounded up as FSDP2's are. Experts count as trainable unless fewer elements are trainable than they
    hold (a frozen base under LoRA).

    Example:
        >>> expert_parallel_model_state_bytes(2, "fp32", trainable=1000, experts=800)
        (2400, 2400, 4800)
        >>> expert_parallel_model_state_bytes(2, "fp32", trainable=1000, experts=800, dp_shard=4)
        (1000, 1000, 2000)
    """
    param, grad, optim = bytes_per_parameter(dtype, optimizer)
    if ep_size < 1:
        raise UsageError(f"ep_size {ep_size} is invalid: it must be >= 1.")
    if dp_shard is not None and (dp_shard < 1 or dp_shard % ep_size):
        raise UsageError(
            f"dp_shard {dp_shard} with ep_size {ep_size} is invalid: ep_size must divide dp_shard (the experts "
            "are sharded over dp_shard / ep_size replicas)."
        )
    trained_experts = min(experts, trainable)
    dense, trained_dense = trainable + frozen - experts, trainable - trained_experts
    if dp_shard is None:
        local = dense + -(-experts // ep_size)
        trained = trained_dense + -(-trained_experts // ep_size)
        return local * param, trained * grad, trained * optim
    replicas = dp_shard // ep_size  # the ranks holding the same experts, among which FSDP2 shards them

    def held(dense_elements: int, expert_elements: int, width: int) -> int:
        rank_experts = -(-expert_elements // ep_size)
        return -(-dense_elements * width // dp_shard) + -(-rank_experts * width // replicas)

    return (
        held(dense, experts, param),
        held(trained_dense, trained_experts, grad),
        held(trained_dense, trained_experts, optim),
    )


def mesh_activation_bytes(
    shape: TransformerShape, layout: MeshLayout, *, batch_size: int, seq_len: int, dtype: str
) -> int:
    """:func:`activation_bytes` under tensor and context parallelism (no sequence parallelism): context
    parallelism divides the sequence a rank holds by ``cp``; tensor parallelism divides the attention and MLP
    activations by ``tp`` (Korthikanti et al.: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` for I = 4h)."""
    s, b, h = seq_len // layout.cp or 1, batch_size, shape.hidden_size
    split = s * b * (8 * h + 4 * shape.intermediate_size) + 5 * shape.num_heads * s * seq_len * b
    per_layer_16bit = s * b * 10 * h + split / layout.tp
    scale = 2 if DTYPE_BYTES[dtype] == 4 else 1
    logits = 4 * s * b * shape.vocab_size if shape.vocab_size else 0
    return math.ceil(shape.num_layers * per_layer_16bit * scale + logits)


def activation_bytes(shape: TransformerShape, *, batch_size: int, seq_len: int, dtype: str) -> int:
    """Activations kept for backward by one rank's micro-batch, without recomputation.

    Per layer, in 16-bit (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022, section 4.1, with the MLP width I instead of 4h):
    ``s*b*(18*h + 4*I) + 5*a*s*s*b`` bytes, where s = sequence length, b = micro-batch size, h = hidden
    size, I = MLP width, a = attention heads (for I = 4h this is their ``s*b*h*(34 + 5*a*s/h)``). fp32
    doubles it. The output logits add ``4*s*b*V`` (fp32 for the loss) when the vocabulary size V is known.
    """
    s, b, h = seq_len, batch_size, shape.hidden_size
    per_layer_16bit = s * b * (18 * h + 4 * shape.intermediate_size) + 5 * shape.num_heads * s * s * b
    scale = 2 if DTYPE_BYTES[dtype] == 4 else 1
    logits = 4 * s * b * shape.vocab_size if shape.vocab_size else 0
    return shape.num_layers * per_layer_16bit * scale + logits


ACTIVATION_FORMULA = (
    "per layer s*b*(18*h + 4*I) + 5*a*s^2*b bytes in 16-bit (x2 in fp32), times layers, plus 4*s*b*V for "
    "fp32 logits (Korthikanti et al. 2022, no recomputation); s=seq_len b=batch_size h=hidden I=MLP width "
    "a=heads V=vocab"
)
