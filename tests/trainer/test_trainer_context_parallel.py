"""The Trainer with ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))``: a tiny transformers
Llama (SDPA) whose sequences are split over 2 CPU processes by torch's ring attention, against the same Trainer
on one process (AdamW, accumulation 2, clipping): logged losses, weights and evaluation within 1e-5, each cp
rank logging the same loss; and what cannot be split refused before it trains wrong."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch

from lockstep import ParallelismConfig, Trainer, TrainingArguments
from lockstep.trainer._training_step.sequence_split import sequence_split_for, split_inputs
from tests.helpers.fsdp_models import full_params
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import run_distributed

transformers = pytest.importorskip("transformers")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
TOLERANCE = 1e-5
SEQ = 16  # a multiple of 2 * cp_size


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(attn_implementation="sdpa"))


def sequences(count: int, seed: int) -> list[dict]:
    """Token rows with a mask of ones; every third row's first 5 labels are -100 (a prompt), so the cp
    chunks hold different numbers of label tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (count, SEQ), generator=generator)
    rows = []
    for index, row in enumerate(ids.tolist()):
        labels = [-100] * 5 + row[5:] if index % 3 == 0 else row
        rows.append({"input_ids": row, "labels": labels, "attention_mask": [1] * SEQ})
    return rows


def _train(output_dir: str, sizes: dict[str, int]) -> dict:
    """Train and evaluate with the ``ParallelismConfig`` of ``sizes`` ({} for one process); the per-device
    training batch is the global batch of 4 split over the data-parallel replicas."""
    replicas = sizes.get("dp_shard_size", 1)
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=ParallelismConfig(**sizes) if sizes else None,
        per_device_train_batch_size=4 // replicas,
        per_device_eval_batch_size=2,  # the batches of one process: eval_loss averages batch means
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        include_num_input_tokens_seen="all",
    )
    trainer = Trainer(
        tiny_llama(),
        args,
        train_dataset=sequences(32, 1),
        eval_dataset=sequences(10, 2),
        compute_metrics=lambda p: {"rows": len(p.label_ids), "label_sum": int(p.label_ids.sum())},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
        metrics = trainer.evaluate()
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "params": full_params(trainer.model_wrapped),
        "metrics": {k: v for k, v in metrics.items() if k in ("eval_loss", "eval_rows", "eval_label_sum")},
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "total_train_batch_size": trainer.state.total_train_batch_size,
        "max_steps": trainer.state.max_steps,
        "mesh": trainer.accelerator.torch_device_mesh.mesh_dim_names if sizes else None,
    }


@pytest.mark.distributed
def test_the_trainer_with_cp2_matches_one_process(tmp_path):
    expected = run_distributed(_train, 1, str(tmp_path / "one"), {}, timeout=240, env=QUIET)[0]
    results = run_distributed(_train, 2, str(tmp_path / "cp"), {"cp_size": 2}, timeout=240, env=QUIET)
    assert len(expected["losses"]) == expected["max_steps"] == 4
    assert expected["metrics"]["eval_rows"] == 10
    for result in results:
        assert result["mesh"] == ("cp",)
        # one data-parallel replica: the global batch is 4 x 2, not 4 x 2 x 2 processes
        assert result["total_train_batch_size"] == expected["total_train_batch_size"] == 8
        assert result["max_steps"] == expected["max_steps"]
        assert result["tokens_seen"] == expected["tokens_seen"] == 32 * SEQ
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert result["grad_norms"] == pytest.approx(expected["grad_norms"], rel=TOLERANCE)
        assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE
        # evaluation runs whole sequences on each cp rank: every sample counted once
        assert result["metrics"]["eval_rows"] == 10
        assert result["metrics"]["eval_label_sum"] == expected["metrics"]["eval_label_sum"]
        assert result["metrics"]["eval_loss"] == pytest.approx(
            expected["metrics"]["eval_loss"], abs=TOLERANCE
        )
    assert results[0]["losses"] == results[1]["losses"]  # averaged over the cp group: the same on each rank


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_with_dp_shard2_by_cp2_matches_one_process(tmp_path):
    expected = run_distributed(_train, 1, str(tmp_path / "one"), {}, timeout=240, env=QUIET)[0]
    sizes = {"dp_shard_size": 2, "cp_size": 2}
    results = run_distributed(_train, 4, str(tmp_path / "dp_cp"), sizes, timeout=400, env=QUIET)
    for result in results:
        assert result["mesh"] == ("dp_shard", "cp")
        assert result["total_train_batch_size"] == 8 and result["tokens_seen"] == expected["tokens_seen"]
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE
        assert result["metrics"] == pytest.approx(expected["metrics"], abs=TOLERANCE)
    assert all(result["losses"] == results[0]["losses"] for result in results)


def test_the_batch_is_prepared_for_the_split_and_left_whole():
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    inputs = split_inputs(batch, 2)
    assert sorted(inputs) == ["attention_mask", "input_ids", "labels", "position_ids", "shift_labels"]
    assert inputs["attention_mask"].tolist() == [[1] * 8] * 2
    assert inputs["shift_labels"].tolist() == [
        [-100, -100, 3, 4, 5, 6, 7, -100],
        [9, 10, 11, 12, 13, 14, 15, -100],
    ]
    assert inputs["position_ids"].tolist() == [list(range(8))] * 2
    assert all(inputs[key].is_contiguous() for key in inputs)
    assert all(inputs[key] is not batch[key] for key in batch)  # split copies: the batch stays whole
    given = {"input_ids": ids, "labels": labels, "shift_labels": labels, "position_ids": ids % 4}
    assert split_inputs(given, 2)["shift_labels"].equal(labels)  # a collator's own are kept
    assert split_inputs(given, 2)["position_ids"].equal(ids % 4)
    assert "attention_mask" not in split_inputs(given, 2, with_mask=False)
    assert (
        split_inputs(given, 2)["attention_mask"].tolist() == [[1] * 8] * 2
    )  # made: see the module docstring


def test_what_cannot_be_split_is_refused_with_what_to_do():
    where = r"Trainer with ParallelismConfig\(cp_size=2\)"
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with pytest.raises(
        NotImplementedError, match=rf"{where}: the batch's attention_mask holds zeros \(padding\)"
    ):
        split_inputs({"input_ids": ids, "labels": ids, "attention_mask": mask}, 2)
    with pytest.raises(
        ValueError, match=rf"{where}: the batch's sequences have 6 tokens, .* 2 \* cp_size = 4"
    ):
        split_inputs({"input_ids": ids[:, :6], "labels": ids[:, :6]}, 2)
    with pytest.raises(ValueError, match=rf"{where} splits .* the batch has input_ids: \(2, 8\)\. Give both"):
        split_inputs({"input_ids": ids}, 2)
    with pytest.raises(NotImplementedError, match=r"also holds \['token_type_ids'\] of the same"):
        split_inputs({"input_ids": ids, "labels": ids, "token_type_ids": ids}, 2)
    with pytest.raises(TypeError, match=rf"{where} needs dict batches \(input_ids, labels\), got a tuple"):
        split_inputs((ids, ids), 2)


def test_models_and_arguments_that_cannot_split_a_sequence_are_refused_before_training():
    accelerator = SimpleNamespace(  # a layout with cp_size=2: its backend splits sequences
        parallelism_config=SimpleNamespace(cp_size=2), capability=lambda kind: object()
    )
    args = TrainingArguments(output_dir="unused")
    llama = tiny_llama()

    def check(model: torch.nn.Module, arguments: TrainingArguments = args, **kwargs) -> None:
        options = {"counted": True, "has_loss_func": False} | kwargs
        sequence_split_for(accelerator, model, arguments, **options)  # type: ignore[arg-type]

    with pytest.raises(
        ValueError, match=r"with position_ids and shift_labels, which Linear\.forward does not"
    ):
        check(torch.nn.Linear(2, 2))
    with pytest.raises(
        NotImplementedError, match=r"Trainer\(compute_loss_func=\.\.\.\) with ParallelismConfig"
    ):
        check(llama, has_loss_func=True)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM does not take loss keyword arguments"):
        check(llama, counted=False)
    smoothing = TrainingArguments(output_dir="unused", label_smoothing_factor=0.1)
    with pytest.raises(NotImplementedError, match=r"label_smoothing_factor=0\.1: the smoothed loss shifts"):
        check(llama, smoothing)
    neftune = TrainingArguments(output_dir="unused", neftune_noise_alpha=5.0)
    with pytest.raises(NotImplementedError, match=r"neftune_noise_alpha=5\.0: NEFTune scales its noise"):
        check(llama, neftune)
    no_cp = SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=1), capability=lambda kind: None)
    assert sequence_split_for(no_cp, llama, args, counted=False, has_loss_func=True) is None  # type: ignore[arg-type]
