"""``lockstep.utils.merge_fsdp_weights``: the shards of a real 2-process FSDP2 checkpoint become one model
equal to the gathered state dict, called from every rank or from a plain process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.utils import load_state_dict, merge_fsdp_weights
from tests.helpers.fsdp_models import data_loader, loss_of, make_transformer
from tests.helpers.multiprocess import run_distributed


def _train_save_and_merge(folder: str, merged: str) -> dict[str, Any]:
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=["TinyDecoderLayer"], state_dict_type="SHARDED_STATE_DICT"
        )
    )
    model = make_transformer(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in data_loader(8, 4):
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(folder)
    full = accelerator.get_state_dict(model)
    merge_fsdp_weights(folder, merged)  # every rank calls it; the main process writes
    written = sorted(p.name for p in Path(merged).iterdir())
    accelerator.end_training()
    return {"full": full, "written": written}


@pytest.mark.distributed
def test_merge_fsdp_weights_rebuilds_the_full_model(tmp_path):
    folder, merged = tmp_path / "ckpt", tmp_path / "merged"
    results = run_distributed(_train_save_and_merge, 2, str(folder), str(merged))
    full = results[0]["full"]
    assert results[0]["written"] == results[1]["written"] == ["model.safetensors"]
    weights = load_state_dict(merged / "model.safetensors")
    assert weights.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(weights[key], value), key
    model = make_transformer(seed=5)
    model.load_state_dict(weights)  # loads into the plain architecture

    # From a plain process (no group), from the model's own folder, as .bin, removing the shards afterwards.
    shards = folder / "pytorch_model_fsdp_0"
    merge_fsdp_weights(shards, tmp_path / "as_bin", safe_serialization=False, remove_checkpoint_dir=True)
    assert not shards.exists() and (folder / "optimizer_0").is_dir()
    as_bin = load_state_dict(tmp_path / "as_bin" / "pytorch_model.bin")
    assert all(torch.equal(as_bin[key], value) for key, value in full.items())


def test_merge_fsdp_weights_names_a_folder_that_is_not_a_sharded_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a sharded checkpoint"):
        merge_fsdp_weights(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"merge_fsdp_weights\('.*missing'\): no such folder"):
        merge_fsdp_weights(tmp_path / "missing", tmp_path / "out")
