"""A tiny transformers decoder saved with save_pretrained (sharded safetensors), built empty and loaded with
load_checkpoint_and_dispatch on CPU + disk: generate() gives the fully loaded model's tokens."""

from __future__ import annotations

import pytest
import torch

from lockstep import load_checkpoint_and_dispatch
from lockstep.big_modeling import init_empty_weights
from lockstep.utils import compute_module_sizes

transformers = pytest.importorskip("transformers")

from tests.helpers.tiny_llama import make_llama  # noqa: E402

PROMPT = torch.tensor([[5, 17, 42, 8, 23, 11]])


def test_generate_with_disk_offload_equals_the_loaded_model(tmp_path):
    full = make_llama(seed=1, tie_word_embeddings=True, layers=6).eval()
    full.save_pretrained(tmp_path / "model", max_shard_size="40KB")
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 2
    with torch.no_grad():
        expected = full.generate(PROMPT, max_new_tokens=12, do_sample=False)
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(full.config, attn_implementation="sdpa").eval()
    size = compute_module_sizes(model)[""]
    model = load_checkpoint_and_dispatch(
        model,
        tmp_path / "model",
        device_map="auto",
        max_memory={"cpu": size // 3},
        no_split_module_classes=model._no_split_modules,
        offload_folder=tmp_path / "offload",
        skip_keys="past_key_values",
        strict=True,
    )
    devices = model.hf_device_map
    assert devices["model.embed_tokens"] == devices["lm_head"] == "cpu"  # tied: kept together
    assert "disk" in devices.values() and model.model.layers[-1].mlp.up_proj.weight.device.type == "meta"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        tokens = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert tokens.tolist() == expected.tolist()
    assert model.model.layers[-1].mlp.up_proj.weight.device.type == "meta"
