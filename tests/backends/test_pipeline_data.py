"""What each pipeline rank does with a batch: the first stage's rank uses the inputs, the last stage's the
target, and a middle rank (pp=3) neither, so it may pass None for both and its loader does not move its
batches to the device. Training still matches one process (the parity of ``test_pipeline_parallel``)."""

from __future__ import annotations

import pytest
import torch

from lockstep import Accelerator, ParallelismConfig
from tests.backends.test_pipeline_parallel import (
    ACCUMULATION,
    CLIP,
    DEPTH,
    LENGTH,
    PER_REPLICA,
    _check_parity,
    _handler,
)
from tests.helpers.fsdp_models import data_loader, make_transformer
from tests.helpers.multiprocess import run_distributed


def _each_rank_passes_what_it_uses() -> dict:
    config = ParallelismConfig(pp_size=3, pp_handler=_handler("gpipe", num_microbatches=4))
    accelerator = Accelerator(parallelism_config=config, gradient_accumulation_steps=ACCUMULATION)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_REPLICA))
    first, last = model.holds_first_stage, model.holds_last_stage
    losses, norms = [], []
    for x, y in train_dl:
        with accelerator.accumulate(model):
            loss = accelerator.pipeline_step(model, x if first else None, target=y if last else None)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {
        "losses": losses,
        "norms": norms,
        "full": accelerator.get_state_dict(model),
        "roles": (first, last),
        "places_batches": accelerator.backend.data_shard().place_batches,
    }


@pytest.mark.distributed
def test_each_pipeline_rank_reads_only_what_its_stages_use():
    results = run_distributed(_each_rank_passes_what_it_uses, 3, timeout=180)
    assert [r["roles"] for r in results] == [(True, False), (False, False), (False, True)]
    assert [r["places_batches"] for r in results] == [True, False, True]  # the middle rank copies nothing
    diff = _check_parity(results, PER_REPLICA, last_ranks=[2])
    print(f"pp=3, each rank passing only what it uses: parameters within {diff:.1e} of one process")
