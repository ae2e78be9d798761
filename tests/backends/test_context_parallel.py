"""Context parallelism (``ParallelismConfig(cp_size=...)``) on real gloo groups, against one process.

Each ``cp`` rank reads the same batch; ``maybe_context_parallel`` splits it along the sequence (a head and a
tail chunk per rank) and SDPA runs as torch's ring attention with the CPU flash kernel
(:mod:`lockstep.backends.nd.context_parallel`). The reference is the same loop on one process, where the
block does nothing (one case with gradient accumulation 2). Tolerance 1e-5 with AdamW (measured: losses
within 4.8e-7, gradient norms 1e-7 relative, parameters within 2.4e-6 for the plain model with cp=2,
dp_shard=2 x cp=2 and cp=2 x tp=2, 1.0e-6 for the Llama; with SGD the plain model's parameters agree within
3e-8: AdamW divides each gradient entry by its own size, so entries that are nearly zero carry their
rounding differences into the step).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, ParallelismConfig
from lockstep.config.parallelism import TorchContextParallelConfig, TorchTensorParallelConfig
from tests.helpers.fsdp_models import full_params
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

VOCAB, WIDTH, HEADS, SEQ, SAMPLES = 64, 32, 4, 16, 16
TOLERANCE = 1e-5
MLP_PLAN = {"layers.*.mlp.0": "colwise", "layers.*.mlp.2": "rowwise"}


class CausalBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        # No key bias (as in Llama): softmax ignores a shift shared by all keys, so its gradient is zero up to
        # rounding, and AdamW turns that noise into full steps of either sign (1.1e-3 apart after 4 steps).
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, _ = h.shape
        qkv = self.qkv(self.norm(h)).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = self.attend(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(batch, length, WIDTH)
        h = h + self.out(attended)
        return h + self.mlp(h)


class EagerBlock(CausalBlock):
    """Attention written out by hand: context parallelism cannot see it."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


class TinyCausalLM(nn.Module):
    def __init__(self, block: type[CausalBlock] = CausalBlock) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _sequences() -> TensorDataset:
    """Sample ids and token sequences one longer than SEQ (inputs and next-token labels)."""
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.arange(SAMPLES), torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=generator)
    )


def _global_mean(accelerator: Accelerator, value: torch.Tensor) -> float:
    """The loss of the global batch: each rank's loss is the mean over its samples and sequence chunks, and
    every rank holds as many tokens (the processes here are all dp x cp)."""
    value = value.detach().clone()
    if accelerator.num_processes > 1:
        dist.all_reduce(value)
        value /= accelerator.num_processes
    return float(value)


def _train(sizes: dict, batch_size: int, strategy: str = "allgather", accumulation: int = 1) -> dict:
    handler = TorchContextParallelConfig(cp_comm_strategy=strategy) if sizes.get("cp_size", 1) > 1 else None
    plan = TorchTensorParallelConfig(parallelize_plan=MLP_PLAN) if sizes.get("tp_size", 1) > 1 else None
    config = ParallelismConfig(**sizes, cp_handler=handler, tp_handler=plan) if sizes else None
    accelerator = Accelerator(parallelism_config=config, gradient_accumulation_steps=accumulation)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, train_dl = accelerator.prepare(
        model, optimizer, DataLoader(_sequences(), batch_size=batch_size)
    )
    losses, norms, samples, chunks = [], [], [], []
    for indices, tokens in train_dl:
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = torch.arange(SEQ).expand_as(ids).contiguous()
        with accelerator.accumulate(model):
            with accelerator.maybe_context_parallel(
                buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, labels}
            ):
                chunks.append(positions[0].tolist())
                logits = model(ids, positions)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(_global_mean(accelerator, loss))
        samples.append(indices.tolist())
    return {
        "losses": losses,
        "norms": norms,
        "params": full_params(model),
        "samples": samples,
        "chunks": chunks,
        "restored": positions[0].tolist(),
        "mesh": accelerator.torch_device_mesh.mesh_dim_names if config else None,
        "cp_rank": accelerator.context_parallel_rank if config else 0,
    }


def _assert_matches(result: dict, expected: dict) -> None:
    assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
    assert result["norms"] == pytest.approx(expected["norms"], rel=TOLERANCE)
    assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE


@pytest.fixture(scope="module")
def one_process() -> Callable[[int], dict]:
    """The one-process reference for an accumulation, run once per module (the strategy plays no part
    without context parallelism: no handler is built)."""
    runs: dict[int, dict] = {}

    def reference(accumulation: int) -> dict:
        if accumulation not in runs:
            runs[accumulation] = run_distributed(_train, 1, {}, 4, "allgather", accumulation)[0]
        return runs[accumulation]

    return reference


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "accumulation"), [("allgather", 1), ("alltoall", 2)])
def test_context_parallel_on_two_cpu_processes_matches_one_process(strategy, accumulation, one_process):
    expected = one_process(accumulation)
    results = run_distributed(_train, 2, {"cp_size": 2}, 4, strategy, accumulation)
    assert len(expected["losses"]) == SAMPLES // 4 and len(expected["norms"]) == SAMPLES // 4 // accumulation
    for rank, result in enumerate(results):
        assert result["mesh"] == ("cp",) and result["cp_rank"] == rank
        _assert_matches(result, expected)
        assert result["restored"] == list(range(SEQ))  # restored on exit (not in no_restore_buffers)
    # one cp group: the same batches on both ranks, and in the block the chunks (head, tail) of each rank
    assert results[0]["samples"] == results[1]["samples"] == expected["samples"]
    assert results[0]["chunks"][0] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert results[1]["chunks"][0] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert expected["chunks"][0] == list(range(SEQ))  # without cp the block leaves the batch whole


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"dp_shard_size": 2, "cp_size": 2}, {"cp_size": 2, "tp_size": 2}])
def test_cp_by_dp_shard_or_tp_on_four_processes_matches_one_process(sizes, one_process):
    expected = one_process(1)
    batch = 4 // sizes.get("dp_shard_size", 1)
    results = run_distributed(_train, 4, sizes, batch, timeout=180)
    for result in results:
        _assert_matches(result, expected)
    if "dp_shard_size" in sizes:
        assert [r["mesh"] for r in results] == [("dp_shard", "cp")] * 4
        # ranks 0,1 form the cp group of dp rank 0 (same batches); ranks 0 and 2 read different halves
        assert (
            results[0]["samples"] == results[1]["samples"] and results[2]["samples"] == results[3]["samples"]
        )
        assert [a + b for a, b in zip(results[0]["samples"], results[2]["samples"])] == expected["samples"]
    else:
        # the MLP split over tp (ranks 0,1 and 2,3), the sequence over cp (ranks 0,2 and 1,3): one batch
        assert [r["mesh"] for r in results] == [("cp", "tp")] * 4
        assert all(r["samples"] == expected["samples"] for r in results)
        assert [r["chunks"][0][0] for r in results] == [0, 0, 4, 4]


def _tiny_llama(path: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)


def _train_llama(path: str, cp_size: int) -> dict:
    from transformers import LlamaForCausalLM

    config = ParallelismConfig(cp_size=cp_size) if cp_size > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = torch.arange(SEQ).expand_as(ids).contiguous()
        with accelerator.maybe_context_parallel(
            buffers=[ids, labels, positions],
            buffer_seq_dims=[1, 1, 1],
            no_restore_buffers={ids, labels, positions},
        ):
            logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(accelerator, loss))
    return {"losses": losses, "params": full_params(model)}


@requires("transformers")
@pytest.mark.distributed
def test_a_transformers_llama_with_sdpa_matches_one_process_under_context_parallel(tmp_path):
    path = str(tmp_path / "tiny-llama")
    _tiny_llama(path)
    expected = run_distributed(_train_llama, 1, path, 1)[0]
    for result in run_distributed(_train_llama, 2, path, 2, timeout=180):
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE


def _error(block) -> str:
    try:
        block()
    except (ValueError, NotImplementedError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _errors(path: str) -> dict:
    from transformers import LlamaForCausalLM

    accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    messages = {
        "eager_llama": _error(
            lambda: accelerator.prepare(LlamaForCausalLM.from_pretrained(path, attn_implementation="eager"))
        )
    }
    model = accelerator.prepare(TinyCausalLM())
    eager = accelerator.prepare(TinyCausalLM(EagerBlock))
    q = torch.randn(1, HEADS, SEQ, 8)

    def run(buffers, seq_dims, body=lambda: None):
        def block():
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=seq_dims):
                body()

        return _error(block)

    ids = torch.zeros(1, SEQ, dtype=torch.long)
    positions = torch.arange(SEQ).view(1, SEQ)
    messages["no_buffers"] = run(None, None)
    messages["odd_length"] = run([torch.zeros(1, 10, dtype=torch.long)], [1])
    messages["unequal"] = run([ids, torch.zeros(1, 8)], [1, 1])
    messages["no_sdpa"] = run([ids, positions], [1, 1], lambda: eager(ids, positions))
    messages["mask"] = run(
        [q], [2], lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(SEQ // 2, SEQ).bool())
    )
    messages["dropout"] = run(
        [q], [2], lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    )
    messages["not_causal"] = run([q], [2], lambda: F.scaled_dot_product_attention(q, q, q))
    messages["works_after"] = run([ids, positions], [1, 1], lambda: model(ids, positions))
    messages["sdpa_restored"] = F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    return messages


@requires("transformers")
@pytest.mark.distributed
def test_what_context_parallel_cannot_run_fails_clearly(tmp_path):
    path = str(tmp_path / "tiny-llama")
    _tiny_llama(path)
    messages = run_distributed(_errors, 2, path)[0]
    assert messages["eager_llama"].startswith(
        "ValueError: ParallelismConfig(cp_size=2) needs SDPA attention, but LlamaForCausalLM uses "
        "attn_implementation='eager'"
    )
    assert messages["no_buffers"].startswith(
        "ValueError: maybe_context_parallel(buffers=None): with cp_size=2 the batch is split along the sequence"
    )
    assert messages["odd_length"].startswith(
        "ValueError: maybe_context_parallel(): a sequence of 10 tokens cannot be split over cp_size=2"
    )
    assert messages["unequal"].startswith(
        "ValueError: maybe_context_parallel(): the buffers have sequence lengths [16, 8]"
    )
    assert messages["no_sdpa"].startswith(
        "RuntimeError: maybe_context_parallel(): the block ran no F.scaled_dot_product_attention"
    )
    where = "NotImplementedError: The model called F.scaled_dot_product_attention inside maybe_context_parallel() with"
    assert messages["mask"].startswith(f"{where} an attn_mask of shape (8, 16)")
    assert messages["dropout"].startswith(f"{where} dropout_p=0.1")
    assert messages["not_causal"].startswith(f"{where} is_causal=False")
    assert messages["works_after"] == "no error" and messages["sdpa_restored"]


@pytest.mark.parametrize("change", ["removed", "other_parameters"])
def test_a_torch_whose_ring_attention_changed_gets_an_error_naming_its_version(monkeypatch, change):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from lockstep.backends.nd import context_parallel

    if change == "removed":
        monkeypatch.delattr(_attention, "_templated_ring_attention")
    else:
        monkeypatch.setattr(_attention, "_templated_ring_attention", lambda mesh, q, k, v, causal: None)
    expected = (
        f"torch {torch.__version__} lacks _templated_ring_attention(group, seq_dim, op, query, key, value, "
        "is_causal, ...) (torch.distributed.tensor.experimental._context_parallel._attention)"
    )
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        context_parallel._torch_ring_attention()
