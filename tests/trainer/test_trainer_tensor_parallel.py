"""The Trainer with ``TrainingArguments(parallelism_config=ParallelismConfig(tp_size=2))``: a tiny transformers
Llama split by its own plan on 2 CPU processes, against the same Trainer on one process (AdamW, accumulation 2,
clipping): losses, weights and evaluation within 1e-5; the batch arithmetic counts data-parallel replicas only."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch

from lockstep import ParallelismConfig, Trainer, TrainingArguments
from lockstep.trainer.accelerator_factory import parallelism_config_for
from tests.helpers.fsdp_models import full_params
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import run_distributed

transformers = pytest.importorskip("transformers")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
TOLERANCE = 1e-5


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def sequences(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (count, 16), generator=generator)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def _train(output_dir: str, tp_size: int) -> dict:
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=ParallelismConfig(tp_size=tp_size) if tp_size > 1 else None,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = Trainer(tiny_llama(), args, train_dataset=sequences(32, 1), eval_dataset=sequences(10, 2))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
        metrics = trainer.evaluate()
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "params": full_params(trainer.model_wrapped),
        "eval_loss": metrics["eval_loss"],
        "eval_samples": metrics.get("eval_samples"),
        "total_train_batch_size": trainer.state.total_train_batch_size,
        "max_steps": trainer.state.max_steps,
        "mesh": trainer.accelerator.torch_device_mesh.mesh_dim_names if tp_size > 1 else None,
    }


@pytest.mark.distributed
def test_the_trainer_with_tp2_matches_one_process(tmp_path):
    expected = run_distributed(_train, 1, str(tmp_path / "one"), 1, timeout=240, env=QUIET)[0]
    results = run_distributed(_train, 2, str(tmp_path / "tp"), 2, timeout=240, env=QUIET)
    for result in results:
        assert result["mesh"] == ("tp",)
        # one data-parallel replica: the global batch is 4 x 2, not 4 x 2 x 2 processes
        assert result["total_train_batch_size"] == expected["total_train_batch_size"] == 8
        assert result["max_steps"] == expected["max_steps"] == 4
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert result["grad_norms"] == pytest.approx(expected["grad_norms"], rel=TOLERANCE)
        assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE
        assert result["eval_loss"] == pytest.approx(expected["eval_loss"], abs=TOLERANCE)


def test_a_model_split_at_load_time_sets_the_tensor_parallel_size():
    args = TrainingArguments(output_dir="unused")
    loaded = SimpleNamespace(tp_size=2, config=SimpleNamespace(distributed_config=SimpleNamespace(dp_size=2)))
    config = parallelism_config_for(args, loaded)  # type: ignore[arg-type]
    assert (config.tp_size, config.dp_shard_size) == (2, 2)
    assert parallelism_config_for(args, SimpleNamespace(tp_size=None)) is None  # type: ignore[arg-type]
    given = TrainingArguments(output_dir="unused", parallelism_config={"tp_size": 4})
    assert parallelism_config_for(given, loaded).tp_size == 2  # type: ignore[arg-type]


def test_bad_parallelism_configs_fail_at_construction():
    with pytest.raises(TypeError, match=r"must be a ParallelismConfig .* or a dict of its sizes, got int"):
        TrainingArguments(output_dir="unused", parallelism_config=2)
    with pytest.raises(ValueError, match=r"parallelism_config=\{'bogus_size': 2\}\) is invalid: its keys"):
        TrainingArguments(output_dir="unused", parallelism_config={"bogus_size": 2})
    with pytest.raises(ValueError, match="both parallelism_config and deepspeed"):
        TrainingArguments(
            output_dir="unused", parallelism_config={"tp_size": 2}, deepspeed={"zero_optimization": {}}
        )
