"""The user's loop with expert parallelism under the Accelerator, shared by the in-process parity test and the
script ``lockstep launch`` runs (``tests/scripts/ep_launch_train.py``).

Tiny Qwen3-MoE (as in :mod:`tests.expert_parallel.test_parity`), AdamW, ``accelerator.accumulate`` over 2
micro-batches, ``accelerator.backward``, ``accelerator.clip_grad_norm_(..., 1.0)``, 10 optimizer steps; the
loader deals each process its rows of every global batch of 4 sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from tests.expert_parallel.test_parity import (
    ACCUMULATION,
    ADAM_EPS,
    GLOBAL_BATCH,
    LR,
    STEPS,
    _build,
    _micro_batch,
)

MAX_NORM = 1.0


def train(accelerator: Any, kind: str = "qwen3_moe", *, measure: bool = False) -> dict[str, Any]:
    """Train with ``accelerator``; each micro-step's loss and aux loss, each step's norm, the final weights;
    with ``measure``, the bytes of this rank's experts and dense part (parameters and optimizer state)."""
    model = _build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    rows = torch.cat([_micro_batch(i) for i in range(STEPS * ACCUMULATION)])
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // accelerator.num_processes)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, aux, norms = [], [], []
    for ids in loader:
        with accelerator.accumulate(model):
            out = model(input_ids=ids, labels=ids)
            accelerator.backward(out.loss)
            losses.append(out.loss.item())
            aux.append(out.aux_loss.item())
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            optimizer.step()
            optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    state = unwrapped.state_dict()
    result = {
        "rank": accelerator.process_index,
        "first": {n: m.first_expert for n, m in unwrapped.named_modules() if hasattr(m, "first_expert")},
        "losses": losses,
        "aux": aux,
        "norms": norms,
        "state": {name: tensor.detach().clone() for name, tensor in state.items()},
    }
    if measure:
        from lockstep.layers.expert_parallel import expert_memory

        held = expert_memory(unwrapped, optimizer)
        result["memory"] = {
            "experts": held.experts.as_dict(),
            "dense": held.dense.as_dict(),
            "per_block": held.experts_per_block,
        }
    return result
