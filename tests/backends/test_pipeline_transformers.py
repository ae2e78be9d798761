"""A transformers decoder (a tiny ``LlamaForCausalLM``) cut automatically into pipeline stages.

``split_points="auto"`` finds ``model.layers``; torch's tracer captures the model from ``input_ids`` (its KV
cache switched off while tracing), the last stage returns the logits and ``causal_lm_loss`` is the model's
own next-token loss. Two processes (1F1B, 4 micro-batches, AdamW, clipping, accumulation 2) against one
process computing ``model(ids, labels=ids).loss``: losses and final parameters within 1e-5 (measured:
printed, ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Accelerator, ParallelismConfig
from lockstep.backends.pp import causal_lm_loss
from lockstep.backends.pp.split import resolve_split_points, trace_stages
from lockstep.config.pipeline import TorchPipelineParallelConfig
from tests.helpers.multiprocess import run_distributed
from tests.helpers.tiny_llama import make_llama, padded_mask, token_data, token_ids

LENGTH, BATCH, ACCUMULATION, CLIP, LR = 32, 8, 2, 0.5, 1e-3
TOLERANCE = 1e-5


def _train_pipelined() -> dict:
    handler = TorchPipelineParallelConfig(
        schedule="1f1b",
        num_microbatches=4,
        split_points="auto",
        example_args=(token_ids(BATCH),),
        loss_fn=causal_lm_loss,
    )
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(pp_size=2, pp_handler=handler),
        gradient_accumulation_steps=ACCUMULATION,
    )
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, DataLoader(token_data(LENGTH), batch_size=BATCH)
    )
    losses = []
    for ids, labels in loader:
        with accelerator.accumulate(model):
            loss = accelerator.pipeline_step(model, ids, target=labels)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {
        "losses": losses,
        "full": accelerator.get_state_dict(model),
        "local_keys": sorted(model.state_dict()),
    }


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the model's own loss from labels: AdamW, clipping, accumulation 2."""
    model = make_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for index, (ids, labels) in enumerate(DataLoader(token_data(LENGTH), batch_size=BATCH)):
        loss = model(ids, labels=labels).loss
        losses.append(float(loss.detach()))
        (loss / ACCUMULATION).backward()
        if (index + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


@pytest.mark.distributed
def test_tiny_llama_split_automatically_on_two_processes_matches_one_process():
    results = run_distributed(_train_pipelined, 2, timeout=180)
    expected, losses = _reference()
    assert all(loss is None for loss in results[0]["losses"])  # the loss exists on the last stage only
    assert results[1]["losses"] == pytest.approx(losses, abs=TOLERANCE)
    # "auto" cut model.layers in two: the embedding and layers 0-1 on rank 0, the rest on rank 1
    assert "model.embed_tokens.weight" in results[0]["local_keys"]
    assert "model.layers.1.mlp.up_proj.weight" in results[0]["local_keys"]
    assert {"model.layers.2.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"} <= set(
        results[1]["local_keys"]
    )
    full = results[0]["full"]
    assert list(full) == list(expected)
    diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    assert diff <= TOLERANCE
    initial = make_llama().state_dict()
    assert max((full[k] - initial[k]).abs().max().item() for k in expected) > 5e-4  # two optimizer steps ran
    loss_diff = max(abs(a - b) for a, b in zip(results[1]["losses"], losses, strict=True))
    print(f"tiny Llama pp=2: max loss diff {loss_diff:.2e}, max parameter diff {diff:.2e}")


def test_tied_embeddings_split_across_stages_are_refused_naming_the_option():
    model = make_llama(tie_word_embeddings=True)
    points = resolve_split_points(model, "auto", 2)
    assert points == ["model.layers.2"]
    with pytest.raises(
        ValueError,
        match=r"would share one parameter, named model\.embed_tokens\.weight and "
        r"lm_head\.weight .*LlamaConfig\(\.\.\., tie_word_embeddings=False\)",
    ):
        trace_stages(model, (token_ids(2),), points)


def test_causal_lm_loss_is_the_models_own_loss_from_labels():
    model = make_llama()
    ids = token_ids(4)
    labels = ids.clone()
    labels[:, :3] = -100  # ignored positions (e.g. a prompt)
    with torch.no_grad():
        outputs = model(ids, labels=labels)
    assert float(causal_lm_loss(outputs.logits, labels)) == pytest.approx(float(outputs.loss), abs=1e-6)
    assert make_llama().config.use_cache  # the tracer's switch-off is temporary


def _evaluate_with_keywords() -> torch.Tensor:
    # traced with keyword inputs and a mask without padding; evaluated on a padded one
    example = {"input_ids": token_ids(BATCH), "attention_mask": torch.ones_like(token_ids(BATCH))}
    handler = TorchPipelineParallelConfig(schedule="gpipe", num_microbatches=2, example_kwargs=example)
    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_handler=handler))
    model = accelerator.prepare(make_llama())
    model.eval()
    with torch.no_grad():
        return model(input_ids=token_ids(BATCH, seed=5), attention_mask=padded_mask(BATCH))


@pytest.mark.distributed
def test_keyword_inputs_and_a_padded_attention_mask_evaluate_as_one_process():
    results = run_distributed(_evaluate_with_keywords, 2, timeout=120)
    with torch.no_grad():
        expected = make_llama()(input_ids=token_ids(BATCH, seed=5), attention_mask=padded_mask(BATCH)).logits
    for logits in results:  # the last stage's logits, on both ranks
        assert (logits - expected).abs().max().item() <= TOLERANCE
