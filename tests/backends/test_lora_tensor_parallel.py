"""LoRA adapters (peft) under tensor parallelism, with FSDP2 over the data-parallel processes: dp_shard=2 x tp=2
on 4 processes trains like one process (``lockstep/backends/nd/adapter_tensor_parallel.py`` splits each adapted
layer's base by the model's own plan and the adapter matrix with it), adapters on column-wise (``q_proj``,
``v_proj``, ``up_proj``) and row-wise (``o_proj``, ``down_proj``) layers, with accumulation and clipping.

peft and accelerate come from the reference environment, as in ``test_lora.py``. One group of 4 workers: each
first trains the same model in plain PyTorch on the whole global batch (the one-process reference), then through
the Accelerator; then a base split over the tp mesh before the adapters were added is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import lora
from tests.helpers.multiprocess import reset_lockstep_state, run_distributed
from tests.helpers.optional import requires
from tests.helpers.reference import peft_pythonpath

pytestmark = [requires("transformers"), pytest.mark.distributed]

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-6  # measured: see the commit message


def _accelerator() -> Any:
    from lockstep import Accelerator
    from lockstep.parallelism_config import ParallelismConfig

    layout = ParallelismConfig(dp_shard_size=2, tp_size=2)
    return Accelerator(gradient_accumulation_steps=lora.ACCUMULATION, parallelism_config=layout)


def _train(out: Path) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    accelerator = _accelerator()
    model = lora.lora_llama(0, TARGETS)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, lora.loader(2))
    result: dict[str, Any] = lora.train_epoch(accelerator, model, optimizer, data)
    result["adapter"] = lora.adapter_weights(model)
    layers = accelerator.unwrap_model(model).get_base_model().model.layers[0]
    placements = {}
    for name, module in (("q_proj", layers.self_attn.q_proj), ("o_proj", layers.self_attn.o_proj)):
        for part in ("base_layer", "lora_A.default", "lora_B.default"):
            weight = module.get_submodule(part).weight
            placements[f"{name}.{part}"] = (
                [str(p) for p in weight.placements] if isinstance(weight, DTensor) else []
            )
    result["placements"] = placements
    accelerator.save_model(model, str(out / "adapter"))
    if accelerator.is_main_process:
        result["loaded"] = lora.load_adapter(out / "adapter")
    accelerator.wait_for_everyone()
    return result


def _split_before_the_adapters() -> str:
    """A base split over the tp mesh before get_peft_model added the adapters (as transformers'
    from_pretrained(tp_plan="auto") leaves it; split here with torch's own styles): refused."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    accelerator = _accelerator()
    base = lora.base_llama(0)
    parallelize_module(
        base.model, accelerator.torch_device_mesh["tp"], {"layers.*.self_attn.q_proj": ColwiseParallel()}
    )
    model = get_peft_model(base, LoraConfig(r=4, target_modules=lora.TARGETS))
    return lora.message_of(lambda: accelerator.prepare(model))


def _reference_then_layout(paths: list[str], out: str) -> dict[str, Any]:
    lora.use_peft(paths)
    results = {"one process": lora.reference_training(TARGETS)}
    results["dp_shard x tp"] = _train(Path(out))
    reset_lockstep_state()
    results["split before the adapters"] = _split_before_the_adapters()
    reset_lockstep_state()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    paths = peft_pythonpath()
    lora.preload()
    out = str(tmp_path_factory.mktemp("lora_tp"))
    return run_distributed(_reference_then_layout, 4, paths, out, timeout=300, env={"OMP_NUM_THREADS": "1"})[
        0
    ]


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def test_dp_shard_x_tp_trains_the_adapters_like_one_process(runs):
    expected, result = runs["one process"], runs["dp_shard x tp"]
    assert len(result["adapter"]) == 2 * 2 * len(TARGETS)  # 2 layers, lora_A and lora_B per target
    difference = _max_difference(result["adapter"], expected["adapter"])
    print(f"dp_shard=2 x tp=2 vs one process: max |adapter difference| = {difference:.3g}")
    assert difference <= TOLERANCE
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert all(len(names) == len(result["adapter"]) for names in result["with_grad"])


def test_the_base_and_the_adapter_split_together(runs):
    placements = runs["dp_shard x tp"]["placements"]
    # (dp_shard, tp) placements, as str() gives them: S(d) = Shard(d); _S(0, 2) = FSDP2's strided shard of a
    # tensor tp already split on dim 0. A matrix that stays whole over tp is sharded by FSDP2 only.
    assert placements == {
        "q_proj.base_layer": ["_S(0, 2)", "S(0)"],
        "q_proj.lora_A.default": ["S(0)"],
        "q_proj.lora_B.default": ["_S(0, 2)", "S(0)"],
        "o_proj.base_layer": ["S(0)", "S(1)"],
        "o_proj.lora_A.default": ["S(0)", "S(1)"],
        "o_proj.lora_B.default": ["S(0)"],
    }, placements


def test_the_adapter_folder_is_gathered_whole(runs):
    result = runs["dp_shard x tp"]
    loaded = {name.replace(".default", ""): t for name, t in result["loaded"].items()}
    trained = {name.replace(".default", ""): t for name, t in result["adapter"].items()}
    assert _max_difference(loaded, trained) == 0.0


def test_a_base_split_before_the_adapters_were_added_is_refused(runs):
    message = runs["split before the adapters"]
    assert message.startswith(
        "NotImplementedError: ParallelismConfig(tp_size=2): this peft model's base was split"
    ), message
    assert "let accelerator.prepare() split the base and its adapters together" in message
