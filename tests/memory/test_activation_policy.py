"""Activation policies: gradients bitwise equal to no checkpointing (one process and FSDP2 on two), each
policy really recomputes or moves what it says, clear errors, and the meta-device estimate of the bytes kept
for backward within 10% of the meter on real tensors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lockstep.config.checks import activation_policy as check_policy
from lockstep.memory import activation_policy
from lockstep.memory.activation_meter import KeptActivations, trace_kept_activations
from lockstep.memory.activation_policy import (
    ActivationPolicy,
    apply_activation_policy,
    parse_activation_policy,
)
from tests.helpers.multiprocess import run_distributed

POLICIES = ("none", "full", "every_2", "op", "offload")
WIDTH, DEPTH, BATCH = 16, 4, 6


class Block(nn.Module):
    """A residual MLP block with dropout, so that recomputation must replay the random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.up(self.norm(x)))))


class Model(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Block)]


def _policy(name: str) -> ActivationPolicy:
    return parse_activation_policy(name, owner="test")


def _gradients(name: str, *, count_ops: bool = False) -> tuple[list[torch.Tensor], dict[str, int], list[int]]:
    """Gradients of one step of the policy; the forward and backward operator counts; each block's calls."""
    torch.manual_seed(0)
    model = Model()
    calls = [0] * DEPTH
    for index, block in enumerate(_blocks(model)):
        block.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    apply_activation_policy(model, _blocks(model), _policy(name))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator)
    torch.manual_seed(2)  # dropout's random numbers
    loss = nn.functional.cross_entropy(model(x), y)
    counter = _OpCounter() if count_ops else None
    if counter is not None:
        with counter:
            loss.backward()
    else:
        loss.backward()
    return [p.grad for p in model.parameters()], dict(counter.counts if counter else {}), calls


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", POLICIES[1:])
def test_gradients_are_bitwise_those_of_no_checkpointing(name):
    reference, _, _ = _gradients("none")
    grads, _, _ = _gradients(name)
    assert len(grads) == len(reference)
    for got, want in zip(grads, reference, strict=True):
        assert torch.equal(got, want)


def test_each_policy_recomputes_what_it_says():
    """The operators replayed in backward. Recomputation stops after the last tensor backward needs (torch's
    early stop), so the down projection never reruns: ``full`` replays each block's up projection, ReLU and norm,
    ``every_2`` every second block's, and ``op`` the ReLU and norm but not the up projection (kept)."""
    replayed = {}
    for name in ("none", "full", "every_2", "op"):
        _, counts, calls = _gradients(name, count_ops=True)
        replayed[name] = (
            counts.get("addmm", 0),
            counts.get("relu", 0),
            counts.get("native_layer_norm", 0),
            calls,
        )
    assert replayed["none"] == (0, 0, 0, [1, 1, 1, 1])
    assert replayed["full"] == (DEPTH, DEPTH, DEPTH, [2, 2, 2, 2])
    assert replayed["every_2"] == (DEPTH // 2, DEPTH // 2, DEPTH // 2, [1, 2, 1, 2])
    assert replayed["op"] == (0, DEPTH, DEPTH, [2, 2, 2, 2])


def test_offload_takes_every_saved_activation_of_the_blocks():
    """An outer saved-tensors hook sees only what the head saves once the blocks' own hooks take theirs;
    the offload hooks see the blocks' activations (and never their weights)."""

    def outer_saves(name: str) -> int:
        torch.manual_seed(0)
        model = Model()
        apply_activation_policy(model, _blocks(model), _policy(name))
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
            model(torch.randn(BATCH, WIDTH)).sum()
        return len(seen)

    offloaded: list[torch.Size] = []
    activation_policy.OFFLOAD_OBSERVERS.append(lambda t: offloaded.append(t.shape))
    try:
        assert outer_saves("offload") == 2  # the head's input and weight
    finally:
        activation_policy.OFFLOAD_OBSERVERS.pop()
    assert outer_saves("none") > 2 + 6 * DEPTH
    assert offloaded and all(shape[0] == BATCH for shape in offloaded)


def test_unknown_policies_say_what_was_passed_and_what_is_valid():
    with pytest.raises(
        ValueError,
        match=r"^FSDP\(activation_checkpointing\)='every_0' is not an activation policy: use one of none, full, every_<k>, op, offload",
    ):
        parse_activation_policy("every_0", owner="FSDP(activation_checkpointing)")
    with pytest.raises(
        ValueError,
        match=r"fsdp_config.fsdp_activation_checkpointing must be true, false or an activation policy \(none, full, every_<k>, op, offload\), got 'sometimes'",
    ):
        check_policy("sometimes", "fsdp_config.fsdp_activation_checkpointing")
    assert [check_policy(v, "k") for v in ("true", "off", "OP", "every_3", "every_1", "offload")] == [
        True,
        False,
        "op",
        "every_3",
        True,
        "offload",
    ]


def test_the_plugin_keeps_accelerates_boolean_and_takes_policies():
    from lockstep import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(activation_checkpointing="full")
    assert plugin.activation_checkpointing is True and plugin.activation_policy == ActivationPolicy("full")
    plugin = FullyShardedDataParallelPlugin.from_config_section({"fsdp_activation_checkpointing": "every_2"})
    assert plugin.activation_checkpointing == "every_2" and plugin.activation_policy.every == 2
    with pytest.raises(
        ValueError, match=r"FullyShardedDataParallelPlugin\(activation_checkpointing\)='some'"
    ):
        FullyShardedDataParallelPlugin(activation_checkpointing="some")


def test_the_meta_trace_predicts_the_meter_within_10_percent():
    """What ``lockstep estimate-memory`` reports per policy (a forward on the meta device) against the meter
    on real tensors, for every policy; and the policies order as they should."""
    torch.manual_seed(0)
    model = Model()  # training mode: dropout keeps its masks, on the meta device too
    with torch.device("meta"):
        meta = Model()
    batch = torch.randn(64, WIDTH)
    policies = [_policy(name) for name in POLICIES]
    estimates = trace_kept_activations(
        meta, blocks=_blocks, policies=policies, forward=lambda m: m(torch.zeros(64, WIDTH, device="meta"))
    )
    measured = {}
    for policy, estimate in zip(policies, estimates, strict=True):
        replica = copy.deepcopy(model)
        apply_activation_policy(replica, _blocks(replica), policy)
        with KeptActivations(exclude=replica.parameters()) as meter:
            output = replica(batch.clone())
        measured[policy.name] = meter.kept_bytes()
        assert abs(estimate.kept - measured[policy.name]) <= 0.1 * measured[policy.name], (policy, estimate)
        del output
    assert (
        measured["full"] < min(measured["every_2"], measured["op"]) < measured["none"] == measured["offload"]
    )
    offload = estimates[-1]
    assert 0 < offload.on_device < measured["full"]  # on an accelerator only the head's input stays


def _fsdp_gradients() -> dict[str, list[torch.Tensor]]:
    from torch.distributed.fsdp import FSDPModule

    from lockstep import Accelerator, FullyShardedDataParallelPlugin
    from tests.helpers.multiprocess import reset_lockstep_state

    grads = {}
    for name in POLICIES:
        reset_lockstep_state()
        plugin = FullyShardedDataParallelPlugin(
            activation_checkpointing=name, transformer_cls_names_to_wrap=["Block"]
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
        torch.manual_seed(0)
        model = accelerator.prepare(Model())
        generator = torch.Generator().manual_seed(1 + accelerator.process_index)
        x, y = (
            torch.randn(BATCH, WIDTH, generator=generator),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        torch.manual_seed(2 + accelerator.process_index)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        grads[name] = [p.grad.full_tensor() for p in model.parameters()]
        wrapped = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Wrapper")]
        units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
        grads[name + " units"] = (wrapped, units)
    return grads


def test_fsdp2_gradients_are_bitwise_equal_for_every_policy():
    wrappers = {"none": [], "full": ["FSDPCheckpointWrapper"] * 4, "every_2": ["FSDPCheckpointWrapper"] * 2}
    wrappers |= {"op": ["FSDPCheckpointWrapper"] * 4, "offload": ["FSDPOffloadWrapper"] * 4}
    for rank_grads in run_distributed(_fsdp_gradients, 2):
        for name, expected in wrappers.items():  # the wrappers are the FSDP units (FSDP's hooks run outside)
            wrapped, units = rank_grads[name + " units"]
            assert wrapped == expected, name
            assert units.count("FSDPCheckpointWrapper") + units.count("FSDPOffloadWrapper") == len(
                expected
            ), units
            assert len(units) == 5, units  # four blocks and the root
        reference = rank_grads["none"]
        for name in POLICIES[1:]:
            assert all(torch.equal(a, b) for a, b in zip(rank_grads[name], reference, strict=True)), name


def test_estimate_memory_predicts_a_llamas_kept_activations_within_10_percent():
    """``lockstep estimate-memory --activation-policies`` as users call it, on a tiny Llama (attention, RoPE,
    SwiGLU), against the meter on the real model with the same config."""
    transformers = pytest.importorskip("transformers")
    from lockstep.memory.estimate.policies import model_blocks
    from tests.helpers.cli import lockstep_in_process

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    sizes |= {"num_key_value_heads": 2, "vocab_size": 256}
    settings = [part for key, value in sizes.items() for part in ("--set", f"{key}={value}")]
    result = lockstep_in_process(
        "estimate-memory", "--config-class", "LlamaConfig", *settings, "--model-class", "LlamaForCausalLM",
        "--batch-size", "4", "--seq-len", "64", "--num-processes", "1", "--dtypes", "fp32", "--strategies", "ddp",
        "--activation-policies", ",".join(POLICIES), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    predicted = {row["policy"]: row for row in json.loads(result.stdout)["activation_policies"]}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, use_cache=False)).train()
    ids = torch.randint(0, 256, (4, 64))
    for name in POLICIES:
        replica = copy.deepcopy(model)
        apply_activation_policy(replica, model_blocks(replica), _policy(name))
        with KeptActivations(exclude=[*replica.parameters(), *replica.buffers()]) as meter:
            output = replica(input_ids=ids)
        kept = meter.kept_bytes()
        assert abs(predicted[name]["kept"] - kept) <= 0.1 * kept, (name, predicted[name], kept)
        del output
    assert predicted["offload"]["on_device"] < predicted["full"]["kept"] < predicted["op"]["kept"]
    # with the KV cache on (transformers' default), as a user builds the model: the policy switches it off,
    # else the replay writes the cache again and ``op`` finds more operators than the forward ran
    grads = {}
    for name in ("none", "op"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**sizes, use_cache=name == "op")
        ).train()
        apply_activation_policy(model, model_blocks(model), _policy(name))
        model(input_ids=ids).logits.square().mean().backward()
        grads[name] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["op"], grads["none"], strict=True))


def test_estimate_memory_policy_errors_exit_2():
    from tests.helpers.cli import lockstep_in_process

    model = "tests.memory.test_activation_policy:Model"
    for args, message in [
        (
            [model, "--activation-policies", "sometimes"],
            "'sometimes' is not an activation policy: use one of none",
        ),
        ([model, "--activation-policies", "op"], "Model is not a transformers model: give --input-shape"),
        ([model, "--input-shape", "4,16"], "--input-shape and --block-class go with --activation-policies"),
        (
            [model, "--activation-policies", "op", "--input-shape", "4,16", "--block-class", "Nope"],
            "has no such",
        ),
    ]:
        result = lockstep_in_process("estimate-memory", *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
