"""Issue 46, item 3: the chunked loss in a loop under the Accelerator, 2 processes with accumulation 2, equals
one process on the global batch with the model's own loss (SGD, 2 steps: parameters within 1e-6).

The loop's exact accumulation: each micro-batch's loss is its token losses' sum over the label tokens of the
whole step (every micro-batch of every process), multiplied by the processes (DDP averages the replicas'
gradients), with gradients synchronised on the step's last micro-batch only.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.multiprocess import run_distributed
from tests.long_context._models import make_llama, token_batch

pytest.importorskip("transformers")

WORLD, ACCUMULATION, ROWS, STEPS, SEQUENCE, LR = 2, 2, 2, 2, 128, 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the run: step-major, then micro-batch, then process, ``ROWS`` rows each."""
    return token_batch(seed=7, rows=STEPS * ACCUMULATION * WORLD * ROWS, sequence=SEQUENCE)


def _rows(step: int, micro: int, rank: int) -> slice:
    start = ((step * ACCUMULATION + micro) * WORLD + rank) * ROWS
    return slice(start, start + ROWS)


def _items(labels: torch.Tensor) -> torch.Tensor:
    return labels[:, 1:].ne(-100).sum()


def _train_chunked() -> tuple[list[float], torch.Tensor]:
    from lockstep import Accelerator, chunked_causal_lm_loss, skip_lm_head

    accelerator = Accelerator()
    model = make_llama(sequence=SEQUENCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    lm_head = accelerator.unwrap_model(model).lm_head
    ids, labels = _data()
    rank, losses = accelerator.process_index, []
    for step in range(STEPS):
        cycle = [_rows(step, micro, rank) for micro in range(ACCUMULATION)]
        items = accelerator.reduce(sum(_items(labels[rows]) for rows in cycle), reduction="sum")
        for micro, rows in enumerate(cycle):
            last = micro == ACCUMULATION - 1
            with (
                contextlib.nullcontext() if last else accelerator.no_sync(model),
                skip_lm_head(lm_head) as seen,
            ):
                model(input_ids=ids[rows])
                loss = chunked_causal_lm_loss(
                    seen.hidden_states, lm_head, labels[rows], num_items_in_batch=items, chunk_size=64
                )
                accelerator.backward(loss * accelerator.num_processes)
            losses.append(accelerator.reduce(loss.detach(), reduction="sum").item())
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    return losses, weights


def _train_reference() -> tuple[list[float], torch.Tensor]:
    """One process, the model's own loss (full logits) over each step's whole batch."""
    model = make_llama(sequence=SEQUENCE)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = _data()
    losses = []
    for step in range(STEPS):
        cycle = [_rows(step, micro, rank) for micro in range(ACCUMULATION) for rank in range(WORLD)]
        items = sum(_items(labels[rows]) for rows in cycle)
        for micro in range(ACCUMULATION):
            rows = [_rows(step, micro, rank) for rank in range(WORLD)]
            micro_ids = torch.cat([ids[r] for r in rows])
            micro_labels = torch.cat([labels[r] for r in rows])
            loss = model(input_ids=micro_ids, labels=micro_labels, num_items_in_batch=items).loss
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_two_processes_with_accumulation_equal_one_process():
    results = run_distributed(_train_chunked, WORLD)
    losses, weights = _train_reference()
    assert torch.equal(results[0][1], results[1][1]), "the ranks' weights diverged"
    assert results[0][0] == pytest.approx(losses, rel=1e-6, abs=0)
    before = torch.cat([p.detach().reshape(-1) for p in make_llama(sequence=SEQUENCE).parameters()])
    assert (weights - before).abs().max().item() > 1e-3  # the steps moved the weights
    difference = (results[0][1] - weights).abs().max().item()
    assert difference <= 1e-6, f"max parameter difference {difference:.3g}"
