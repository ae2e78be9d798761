"""TrainingStateTransfer: a replica that lost its state takes the whole training state from a live peer, in
memory (what live recovery needs), and then trains bitwise like the peer that never lost it."""

from __future__ import annotations

import pytest
import torch

from lockstep import Accelerator
from lockstep.backends import TrainingStateTransfer
from lockstep.collectives import broadcast_object_list
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, loader, loss_fn, make_model


def _recover_from_peer() -> dict:
    accelerator = Accelerator()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, batches = accelerator.prepare(model, optimizer, loader(32, 4))
    transfer = accelerator.capability(TrainingStateTransfer)
    assert transfer is not None
    for step, batch in enumerate(batches):
        if step == 2 and accelerator.process_index == 1:  # rank 1 loses its replica: weights and moments
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.normal_()
            optimizer.state.clear()
        if step == 2:
            state = transfer.training_state([model], [optimizer]) if accelerator.is_main_process else None
            state = broadcast_object_list([state], from_process=0)[0]
            if accelerator.process_index == 1:
                transfer.load_training_state([model], [optimizer], state)
        accelerator.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": flat_params(accelerator.unwrap_model(model)),
        "steps": int(optimizer.state_dict()["state"][0]["step"]),
    }


@pytest.mark.distributed
def test_a_replica_that_lost_its_state_takes_it_from_a_peer_and_trains_like_it():
    ranks = run_distributed(_recover_from_peer, 2, timeout=120)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 4
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def test_a_state_for_another_set_up_is_refused():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(make_model())
    transfer = accelerator.capability(TrainingStateTransfer)
    with pytest.raises(
        ValueError, match=r"holds 2 model\(s\) and 0 optimizer\(s\), but this replica prepared 1 and 0"
    ):
        transfer.load_training_state([model], [], {"models": [{}, {}], "optimizers": []})


def test_sharding_backends_do_not_claim_it():
    from lockstep import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    assert accelerator.capability(TrainingStateTransfer) is None
