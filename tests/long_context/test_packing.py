"""Packed documents kept apart (issue 46, item 2): one row of two 32-token documents, ``position_ids``
restarting at 0 for the second, no attention mask, the loss on document 2 only.

Measured before the fix (tiny Llama, SDPA or eager, one process, ``use_cache`` left at the config's True):
document 2's loss 2.6e-3 away from document 2 fed alone, and one token of document 1 moves it by 3.4e-4.
With the prepared model's block-causal mask: document 2's logits equal document 2 alone (0.0 here), its loss
within 4.8e-7 (a sum over 31 targets in another order), and document 1 changes nothing of document 2.
Under ``ParallelismConfig(cp_size=2)`` the packed batch is refused by name on both ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lockstep import Accelerator, ParallelismConfig
from lockstep.layers.long_context import block_causal_mask, document_ids
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

DOC, VOCAB = 32, 64
TOLERANCE = 1e-6


def _llama(implementation: str = "sdpa") -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(max_position_embeddings=2 * DOC, attention_dropout=0.0)
    return LlamaForCausalLM._from_config(config, attn_implementation=implementation)


def _packed_row(changed_token: bool = False) -> dict[str, torch.Tensor]:
    """Document 1 then document 2 in one row; labels on document 2's tokens after its first (as
    ``DataCollatorWithFlattening`` masks each document's first label)."""
    generator = torch.Generator().manual_seed(1)
    first, second = (torch.randint(0, VOCAB, (1, DOC), generator=generator) for _ in range(2))
    if changed_token:
        first[0, 5] = (first[0, 5] + 1) % VOCAB
    ids = torch.cat([first, second], dim=1)
    labels = ids.clone()
    labels[:, : DOC + 1] = -100
    positions = torch.cat([torch.arange(DOC), torch.arange(DOC)])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "second": second}


def _document_two(model: Any, changed_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    row = _packed_row(changed_token)
    out = model(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"])
    return out.loss, out.logits[0, DOC:]


def _alone(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    second = _packed_row()["second"]
    out = model(input_ids=second, labels=second)
    return out.loss, out.logits[0]


def test_document_ids_and_the_block_causal_mask() -> None:
    assert document_ids(torch.tensor([[0, 1, 2, 0, 1], [5, 6, 7, 8, 9]])).tolist() == [
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0],
    ]
    assert document_ids(torch.arange(6)[None]) is None  # one document per row: no mask at all
    assert document_ids(None, torch.tensor([0, 2, 5])).tolist() == [[0, 0, 1, 1, 1]]
    mask = block_causal_mask(torch.tensor([[0, 0, 1]]))
    assert mask.shape == (1, 1, 3, 3) and mask[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    additive = block_causal_mask(torch.tensor([[0, 1]]), additive=True)[0, 0]
    assert additive.tolist() == [[0.0, torch.finfo(torch.float32).min], [torch.finfo(torch.float32).min, 0.0]]


@requires("transformers")
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_documents_never_see_each_other_on_one_process(implementation: str) -> None:
    plain = _llama(implementation)
    leak = (_document_two(plain)[0] - _alone(plain)[0]).abs().item()
    moved = (_document_two(plain, changed_token=True)[0] - _document_two(plain)[0]).abs().item()
    assert leak > 1e-3 and moved > 1e-4  # plain transformers (use_cache=True): document 2 sees document 1

    model = Accelerator().prepare(_llama(implementation))
    loss, logits = _document_two(model)
    alone_loss, alone_logits = _alone(model)
    assert (logits - alone_logits).abs().max().item() <= TOLERANCE
    assert abs(loss.item() - alone_loss.item()) <= TOLERANCE
    changed_loss, changed_logits = _document_two(model, changed_token=True)
    assert torch.equal(changed_logits, logits) and torch.equal(changed_loss, loss)


@requires("transformers")
def test_packed_gradients_equal_the_document_alone() -> None:
    model = Accelerator().prepare(_llama())
    _document_two(model)[0].backward()
    packed = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad()
    _alone(model)[0].backward()
    alone = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert (packed - alone).abs().max().item() <= TOLERANCE


@requires("transformers")
def test_unpacked_batches_are_unchanged_bit_for_bit() -> None:
    plain, prepared = _llama(), Accelerator().prepare(_llama())
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 2 * DOC), generator=generator)
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    batches = [
        {"input_ids": ids, "labels": ids},
        {"input_ids": ids, "labels": ids, "position_ids": torch.arange(2 * DOC).expand(2, -1)},
        {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)},
        {"input_ids": ids, "labels": ids, "attention_mask": padding},
    ]
    for batch in batches:
        assert torch.equal(prepared(**batch).loss, plain(**batch).loss)


def _packed_under(parallelism: dict[str, int]) -> dict[str, Any]:
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**parallelism) if parallelism else None)
    model = accelerator.prepare(_llama())
    row = _packed_row()
    if (
        "cp_size" not in parallelism
    ):  # data parallel (DDP, FSDP2): each rank's row kept apart as on one process
        loss, logits = _document_two(model)
        alone_loss, alone_logits = _alone(model)
        return {
            "loss": abs(loss.item() - alone_loss.item()),
            "logits": (logits - alone_logits).abs().max().item(),
        }

    def error(**extra: torch.Tensor) -> str:
        ids, positions = row["input_ids"].clone(), row["position_ids"].clone()
        try:
            with accelerator.maybe_context_parallel(buffers=[ids, positions], buffer_seq_dims=[1, 1]):
                model(input_ids=ids, position_ids=positions, **extra)
        except NotImplementedError as raised:
            return str(raised)
        return "no error"

    messages = {
        "position_ids": error(),
        "cu_seq_lens": error(cu_seq_lens_q=torch.tensor([0, DOC, 2 * DOC])),
    }
    ids = row["second"].repeat(1, 2)  # one document per row still trains under cp
    positions = torch.arange(2 * DOC)[None]
    with accelerator.maybe_context_parallel(buffers=[ids, positions], buffer_seq_dims=[1, 1]):
        messages["unpacked"] = type(model(input_ids=ids, position_ids=positions).logits).__name__
    return messages


@requires("transformers")
@pytest.mark.distributed
def test_packed_documents_under_context_parallel_are_refused_by_name_on_every_rank() -> None:
    for messages in run_distributed(_packed_under, 2, {"cp_size": 2}):
        assert messages["unpacked"] == "Tensor"
        assert messages["position_ids"].startswith(
            "ParallelismConfig(cp_size > 1): LlamaForCausalLM got position_ids that restart inside a row "
            "(packed documents) inside maybe_context_parallel()."
        )
        assert "every document would attend to the documents packed before it" in messages["position_ids"]
        assert messages["cu_seq_lens"].startswith(
            "ParallelismConfig(cp_size > 1): LlamaForCausalLM got cu_seq_lens_q inside"
        )


@requires("transformers")
@pytest.mark.distributed
@pytest.mark.parametrize("parallelism", [{}, {"dp_shard_size": 2}], ids=["ddp", "fsdp2"])
def test_packed_documents_under_ddp_and_fsdp2_are_kept_apart(parallelism: dict[str, int]) -> None:
    for result in run_distributed(_packed_under, 2, parallelism):
        assert result["loss"] <= TOLERANCE and result["logits"] <= TOLERANCE


def _trainer_under_context_parallel(output_dir: str) -> str:
    from lockstep import Trainer, TrainingArguments

    row = _packed_row()
    packed = {key: row[key][0].tolist() for key in ("input_ids", "labels", "position_ids")}
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=ParallelismConfig(cp_size=2),
        per_device_train_batch_size=1,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(_llama(), args, train_dataset=[packed, packed])
    try:
        trainer.train()
    except NotImplementedError as raised:
        return str(raised)
    return "no error"


@requires("transformers")
@pytest.mark.distributed
def test_the_trainer_refuses_packed_documents_under_context_parallel(tmp_path: Any) -> None:
    for message in run_distributed(_trainer_under_context_parallel, 2, str(tmp_path)):
        assert message.startswith(
            "ParallelismConfig(cp_size > 1): LlamaForCausalLM got position_ids that restart inside a row"
        )
