"""Issue 46, item 3: the chunked loss vocabulary-parallel under tensor parallelism (``loss_parallel``).

``ParallelismConfig(tp_size=2)`` on 2 processes shards the tiny Llama's ``lm_head`` by vocabulary rows
(transformers' plan); the chunked loss projects each chunk onto this rank's half only and never gathers the
logits (no tensor of ``tokens x vocab / 2`` elements or more), and 2 SGD steps equal one process with the
model's own loss (losses within 1e-6 relative, weights within 1e-6); so does the Trainer with
``loss_type="chunked_nll"`` (logged losses, eval_loss, weights). FSDP2's shards of ``lm_head`` (the same
``Shard(0)`` layout, over ranks that hold other tokens) are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tests.long_context._models import VOCAB, LargestAllocation, full_weights, make_llama, token_batch
from tests.long_context.test_trainer_chunked_loss import _assert_same, _train

pytest.importorskip("transformers")

ROWS, STEPS, SEQUENCE, LR, CHUNK = 2, 2, 128, 0.5, 64


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(seed=5, rows=STEPS * ROWS, sequence=SEQUENCE)


def _train_tensor_parallel(output_dir: str) -> dict:
    from lockstep import Accelerator, ParallelismConfig, chunked_causal_lm_loss, skip_lm_head

    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = make_llama(sequence=SEQUENCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    lm_head = accelerator.unwrap_model(model).lm_head
    ids, labels = _data()
    losses, largest = [], 0
    for step in range(STEPS):
        rows = slice(step * ROWS, (step + 1) * ROWS)
        with LargestAllocation() as allocations:
            with skip_lm_head(lm_head) as seen:
                model(input_ids=ids[rows])
            loss = chunked_causal_lm_loss(seen.hidden_states, lm_head, labels[rows], chunk_size=CHUNK)
            accelerator.backward(loss)
        largest = max(largest, allocations.largest)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {
        "losses": losses,
        "weights": full_weights(accelerator.unwrap_model(model)),
        "largest": largest,
        "local_vocab": lm_head.weight.to_local().shape[0],
    }
    from tests.helpers.multiprocess import reset_lockstep_state

    reset_lockstep_state()  # the same processes then run the Trainer, with a fresh Accelerator
    result["trainer"] = _train(output_dir, "chunked_nll", tp_size=2)
    reset_lockstep_state()
    return {**result, "fsdp": _fsdp_refusal()}


def _fsdp_refusal() -> str:
    """FSDP2 leaves lm_head's weight Shard(0) too, but over ranks that hold other tokens: refused by name."""
    from lockstep import Accelerator, FullyShardedDataParallelPlugin, chunked_causal_lm_loss, skip_lm_head

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = accelerator.prepare(make_llama(sequence=SEQUENCE))
    lm_head = accelerator.unwrap_model(model).lm_head
    ids, labels = _data()
    with skip_lm_head(lm_head) as seen:
        model(input_ids=ids[:ROWS])
    with pytest.raises(NotImplementedError) as refused:
        chunked_causal_lm_loss(seen.hidden_states, lm_head, labels[:ROWS])
    return str(refused.value)


def _train_reference() -> dict:
    model = make_llama(sequence=SEQUENCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = _data()
    losses = []
    for step in range(STEPS):
        rows = slice(step * ROWS, (step + 1) * ROWS)
        loss = model(input_ids=ids[rows], labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": full_weights(model)}


def test_tensor_parallel_equals_one_process_without_gathering_the_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_DISABLE_PROGRESS_BARS", "1")
    results = run_distributed(
        _train_tensor_parallel, 2, str(tmp_path / "tp"), env={"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
    )
    reference = _train_reference()
    assert [r["local_vocab"] for r in results] == [VOCAB // 2, VOCAB // 2]
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    difference = (results[0]["weights"] - reference["weights"]).abs().max().item()
    assert difference <= 1e-6, f"max parameter difference {difference:.3g}"
    tokens_by_half_vocab = ROWS * SEQUENCE * VOCAB // 2
    assert max(r["largest"] for r in results) < tokens_by_half_vocab
    # the Trainer with loss_type="chunked_nll" under tp_size=2 equals one process's Trainer with the model's loss
    assert torch.equal(results[0]["trainer"]["weights"], results[1]["trainer"]["weights"])
    _assert_same(results[0]["trainer"], _train(str(tmp_path / "one"), "nll"))
    assert "FSDP's shards and other layouts are not built yet" in results[0]["fsdp"]
