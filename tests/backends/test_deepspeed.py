"""DeepSpeed ZeRO stages 0-3: parity with one process on the global batch, accumulation, clipping, the
config's optimizer through DummyOptim and "auto", and the wrappers the loop holds.

Tolerances: with SGD the parameters after 12 steps agree with one process within 1e-6 (float reordering of
the gradient reduction); Adam divides by sqrt(v), which amplifies that noise, so AdamW runs agree within 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fsdp_models import data_loader, loss_of, make_transformer, reference_run
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

pytestmark = [requires("deepspeed"), pytest.mark.distributed, pytest.mark.usefixtures("deepspeed_preloaded")]

LENGTH, PER_PROCESS = 48, 4
AUTO_ADAMW = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 0.0,  # DeepSpeed's own default clips at 1.0
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


def _train(stage: int, options: dict) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin, DummyOptim

    accumulation = options.get("accumulation", 1)
    if options.get("config"):
        config = {**options["config"], "zero_optimization": {"stage": stage}}
        plugin = DeepSpeedPlugin(hf_ds_config=config)
    else:
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=options.get("clip", 0.0))
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=accumulation)
    model = make_transformer()
    if options.get("config"):
        optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = data_loader(LENGTH, PER_PROCESS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, batch))
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and options.get("clip"):
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), options["clip"])))
    config = accelerator.deepspeed_plugin.deepspeed_config
    return {
        "params": _gathered(model),
        "norms": norms,
        "engine": type(model).__name__,
        "optimizer": type(optimizer).__name__,
        "skipped": accelerator.optimizer_step_was_skipped,
        "micro_batch": config["train_micro_batch_size_per_gpu"],
        "train_batch": config["train_batch_size"],
        "gas": config["gradient_accumulation_steps"],
        "stage": model.zero_optimization_stage(),
    }


def _gathered(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


@pytest.mark.parametrize(
    ("stage", "options"),
    [
        (0, {}),
        (1, {"accumulation": 2}),
        (2, {}),
        (2, {"accumulation": 2, "clip": 0.5}),
        (3, {}),
        (3, {"accumulation": 2}),
    ],
    ids=["zero0", "zero1-accumulate", "zero2", "zero2-accumulate-clip", "zero3", "zero3-accumulate"],
)
def test_two_processes_train_like_one_process_on_the_global_batch(stage, options):
    accumulation = options.get("accumulation", 1)
    expected, expected_norms = reference_run(
        LENGTH, PER_PROCESS * 2 * accumulation, accumulation=accumulation, clip=options.get("clip")
    )
    results = run_distributed(_train, 2, stage, options, timeout=180)
    for result in results:
        assert result["engine"] == "DeepSpeedEngine" and result["stage"] == stage
        assert result["optimizer"] == "DeepSpeedOptimizerWrapper" and not result["skipped"]
        assert (result["micro_batch"], result["gas"]) == (PER_PROCESS, accumulation)
        assert result["train_batch"] == PER_PROCESS * 2 * accumulation
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=1e-6)
    if options.get("clip"):
        assert results[0]["norms"] == pytest.approx(expected_norms, rel=1e-5)


def test_the_configs_optimizer_through_dummy_optim_fills_auto_and_matches():
    expected, _ = reference_run(LENGTH, PER_PROCESS * 2, adamw=True)
    results = run_distributed(_train, 2, 2, {"config": AUTO_ADAMW}, timeout=180)
    for result in results:
        assert result["optimizer"] == "DeepSpeedOptimizerWrapper"
        assert (result["micro_batch"], result["train_batch"], result["gas"]) == (
            PER_PROCESS,
            PER_PROCESS * 2,
            1,
        )
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_four_processes_zero3_train_like_one_process():
    expected, _ = reference_run(LENGTH, PER_PROCESS * 4)
    results = run_distributed(_train, 4, 3, {}, timeout=300)
    for result in results:
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=1e-6)
