"""Pipeline parallelism (``ParallelismConfig(pp_size=...)``) on real gloo groups, against one process.

Every run trains a 4-block ``TinyTransformer`` with AdamW, gradient clipping and 2 accumulation steps
through ``accelerator.pipeline_step`` and compares the per-batch losses, the gradient norms and the final
parameters (gathered by ``get_state_dict``) with plain PyTorch on one process over the same global batches.
Tolerance: 1e-5 (the issue's bar), absolute, on losses and parameters; norms relative 1e-5. Measured: the
largest difference is printed by each test (typically ~1e-7: float reordering of the micro-batch sums).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from lockstep.config.pipeline import TorchPipelineParallelConfig
from tests.helpers.fsdp_models import (
    FEATURES,
    data_loader,
    make_data,
    make_transformer,
)
from tests.helpers.multiprocess import run_distributed

LENGTH, PER_REPLICA, DEPTH, ACCUMULATION, CLIP = 48, 8, 4, 2, 0.5
TOLERANCE = 1e-5


def _handler(schedule: str, **options) -> TorchPipelineParallelConfig:
    return TorchPipelineParallelConfig(
        schedule=schedule,
        example_args=(torch.zeros(PER_REPLICA, FEATURES),),
        loss_fn=nn.functional.mse_loss,
        **options,
    )


def _train(sizes: dict, schedule: str, options: dict) -> dict:
    config = ParallelismConfig(**sizes, pp_handler=_handler(schedule, **options))
    accelerator = Accelerator(parallelism_config=config, gradient_accumulation_steps=ACCUMULATION)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before prepare: re-bound to the stages
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_REPLICA))
    losses, norms = [], []
    for x, y in train_dl:
        with accelerator.accumulate(model):
            loss = accelerator.pipeline_step(model, x, target=y)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {
        "losses": losses,
        "norms": norms,
        "full": accelerator.get_state_dict(model),
        "stages": model.stage_indices,
        "pp_rank": accelerator.pipeline_parallel_rank,
        "mesh": accelerator.torch_device_mesh.mesh_dim_names,
        "local_keys": sorted(model.state_dict()),
        "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
    }


def _reference(global_batch: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, plain PyTorch: AdamW, clipping, accumulation over ``ACCUMULATION`` batches."""
    data = make_data(LENGTH)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for index, start in enumerate(range(0, LENGTH, global_batch)):
        x, y = data[start : start + global_batch]
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(float(loss.detach()))
        (loss / ACCUMULATION).backward()
        if (index + 1) % ACCUMULATION == 0 or start + global_batch >= LENGTH:  # a loader's last batch steps
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}, losses, norms


def _check_parity(results: list[dict], global_batch: int, last_ranks: list[int]) -> float:
    expected, losses, norms = _reference(global_batch)
    # the last stage's ranks report the loss of their replica's batch: their mean is the global batch's
    reported = [
        sum(results[r]["losses"][i] for r in last_ranks) / len(last_ranks) for i in range(len(losses))
    ]
    assert reported == pytest.approx(losses, abs=TOLERANCE)
    for result in results:
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
    full = results[0]["full"]
    assert list(full) == list(expected)  # every stage's weights, in the model's own order
    diff = max((full[k] - expected[k]).abs().max().item() for k in expected)
    assert diff <= TOLERANCE
    return diff


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("schedule", "stages"),
    [
        ("gpipe", [[0], [1]]),
        ("1f1b", [[0], [1]]),
        ("interleaved_1f1b", [[0, 2], [1, 3]]),
        ("looped_bfs", [[0, 2], [1, 3]]),
        ("interleaved_zero_bubble", [[0, 2], [1, 3]]),
        ("zbv_zero_bubble", [[0, 3], [1, 2]]),  # the V layout: the last stage is back on rank 0
    ],
)
def test_pipeline_on_two_processes_matches_one_process(schedule, stages):
    results = run_distributed(_train, 2, {"pp_size": 2}, schedule, {"num_microbatches": 4}, timeout=120)
    assert [r["stages"] for r in results] == stages
    assert [r["pp_rank"] for r in results] == [0, 1] and results[0]["mesh"] == ("pp",)
    last = 0 if schedule == "zbv_zero_bubble" else 1
    assert all(loss is None for loss in results[1 - last]["losses"])  # only the last stage has a loss
    assert results[1]["full"] == {}  # the full state dict is gathered on the main process
    # each rank holds (and optimizes) only its own stages' parameters
    assert not set(results[0]["local_keys"]) & set(results[1]["local_keys"])
    assert sum(r["optimizer_params"] for r in results) == len(
        list(make_transformer(depth=DEPTH).parameters())
    )
    print(f"{schedule}: max parameter diff {_check_parity(results, PER_REPLICA, [last]):.2e}")


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_by_fully_sharded_data_parallel_on_four_processes_matches_one_process():
    # pp=2 outermost x dp_shard=2: ranks 0,1 hold stage 0 (sharded between them), ranks 2,3 stage 1;
    # each dp replica reads its own 8 samples, so the global batch is 16
    sizes = {"pp_size": 2, "dp_shard_size": 2}
    results = run_distributed(_train, 4, sizes, "1f1b", {"num_microbatches": 2}, timeout=240)
    assert [r["stages"] for r in results] == [[0], [0], [1], [1]]
    assert [r["pp_rank"] for r in results] == [0, 0, 1, 1] and results[0]["mesh"] == ("pp", "dp_shard")
    print(f"pp x dp_shard: max parameter diff {_check_parity(results, 2 * PER_REPLICA, [2, 3]):.2e}")


EVAL_LENGTH = 44  # five batches of 8 and a last one of 4 (padded to 8 for the stages, then cut back)


def _evaluate(schedule: str, options: dict) -> dict:
    config = ParallelismConfig(pp_size=2, pp_handler=_handler(schedule, **options))
    accelerator = Accelerator(parallelism_config=config)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, train_dl, eval_dl = accelerator.prepare(
        model, optimizer, data_loader(LENGTH, PER_REPLICA), data_loader(EVAL_LENGTH, PER_REPLICA)
    )

    def evaluate() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            outputs = [accelerator.gather_for_metrics(model(x)) for x, _ in eval_dl]
        model.train()
        return torch.cat(outputs)

    before = evaluate()
    x, y = next(iter(train_dl))
    accelerator.pipeline_step(model, x, target=y)  # training after evaluation: the schedule re-infers shapes
    optimizer.step()
    optimizer.zero_grad()
    after = evaluate()
    with torch.no_grad():  # training mode under no_grad evaluates too
        batch_outputs = model(x)
    return {
        "before": before,
        "after": after,
        "batch": batch_outputs,
        "replicas": float(accelerator.reduce(torch.tensor(1.0), reduction="sum")),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_evaluation_returns_the_last_stage_outputs_on_every_rank(schedule):
    results = run_distributed(_evaluate, 2, schedule, {"num_microbatches": 2}, timeout=120)
    data = make_data(EVAL_LENGTH).tensors[0]
    model = make_transformer(depth=DEPTH)
    with torch.no_grad():
        expected_before = model(data)
    x, y = make_data(LENGTH)[:PER_REPLICA]
    nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with torch.no_grad():
        expected_after, expected_batch = model(data), model(x)
    for result in results:  # every rank: all 44 samples once, in order (the padded tail cut back)
        assert result["before"].shape == (EVAL_LENGTH, 1)
        assert (result["before"] - expected_before).abs().max().item() <= TOLERANCE
        assert (result["after"] - expected_after).abs().max().item() <= TOLERANCE
        assert (result["batch"] - expected_batch).abs().max().item() <= TOLERANCE
        assert result["replicas"] == 1.0  # reduce/gather run over the data-parallel replicas, not over pp
    assert torch.equal(results[0]["after"], results[1]["after"])


def _save_and_reload(folder: str, model_folder: str) -> dict:
    config = ParallelismConfig(pp_size=2, pp_handler=_handler("1f1b", num_microbatches=2))
    accelerator = Accelerator(parallelism_config=config)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_REPLICA))
    batches = list(train_dl)

    def train(chosen: list) -> torch.Tensor:
        for x, y in chosen:
            accelerator.pipeline_step(model, x, target=y)
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

    saved = train(batches[:2])
    accelerator.save_state(folder)
    accelerator.save_model(model, model_folder)
    full = accelerator.get_state_dict(model)
    moved = train(batches[2:4])
    accelerator.load_state(folder)
    restored = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    again = train(batches[2:4])  # the same two steps again: exact only if the AdamW state came back too
    return {
        "saved": saved,
        "moved": moved,
        "restored": restored,
        "again": again,
        "full": full,
    }


@pytest.mark.distributed
def test_pipeline_checkpoint_round_trip_and_save_model(tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(
        _save_and_reload, 2, str(tmp_path / "ckpt"), str(tmp_path / "model"), timeout=120
    )
    for result in results:
        assert not torch.equal(result["moved"], result["saved"])
        assert torch.equal(result["restored"], result["saved"])
        assert torch.equal(result["again"], result["moved"])
    # every stage's shards in one DCP folder; save_model writes one whole model on the main process
    assert (tmp_path / "ckpt" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (tmp_path / "ckpt" / "optimizer_0" / ".metadata").is_file()
    written = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert sorted(written) == sorted(make_transformer(depth=DEPTH).state_dict())  # safetensors sorts keys
    assert len(results[0]["full"]) == len(written)
    assert all(torch.equal(written[k], v) for k, v in results[0]["full"].items())
    # `lockstep merge-weights` on the pp=2 checkpoint (one process, no group): one whole model, and it
    # loads into the plain (pp=1) model
    from lockstep.cli.main import main

    assert main(["merge-weights", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(merged) == sorted(written)
    assert all(torch.equal(merged[k], written[k]) for k in written)
    plain = make_transformer(seed=1, depth=DEPTH)
    plain.load_state_dict(merged)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in results[0]["full"].items())


def _errors() -> dict:
    from tests.helpers.multiprocess import reset_lockstep_state

    messages: dict[str, str] = {}
    cases = {
        "missing": {"split_points": ["layers.9"]},
        "too_many": {"stages_per_rank": 3, "schedule": "interleaved_1f1b"},  # 6 stages, 4 blocks
    }
    for name, options in cases.items():
        schedule = options.pop("schedule", "1f1b")
        accelerator = Accelerator(
            parallelism_config=ParallelismConfig(pp_size=2, pp_handler=_handler(schedule, **options))
        )
        try:
            accelerator.prepare(make_transformer(depth=DEPTH))
        except ValueError as error:
            messages[name] = str(error)
        reset_lockstep_state()
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(pp_size=2, pp_handler=_handler("gpipe", num_microbatches=4))
    )
    model = accelerator.prepare(make_transformer(depth=DEPTH))
    for name, call in {
        "indivisible": lambda: accelerator.pipeline_step(
            model, torch.zeros(6, FEATURES), target=torch.zeros(6, 1)
        ),
        "direct_call": lambda: model(torch.zeros(8, FEATURES)),
    }.items():
        try:
            call()
        except (ValueError, RuntimeError) as error:
            messages[name] = str(error)
    x = torch.randn(PER_REPLICA, FEATURES)
    reset_lockstep_state()
    accelerator = Accelerator(
        parallelism_config=ParallelismConfig(pp_size=2, pp_handler=_handler("zbv_zero_bubble"))
    )
    model = accelerator.prepare(make_transformer(depth=DEPTH))
    model.eval()
    try:
        model(x)
    except NotImplementedError as error:
        messages["zbv_eval"] = str(error)
    return messages


@pytest.mark.distributed
def test_bad_split_points_stage_counts_and_batches_are_clear_errors():
    messages = run_distributed(_errors, 2, timeout=120)[0]
    assert messages["missing"].startswith(
        "TorchPipelineParallelConfig(split_points=['layers.9']) names 'layers.9', which is no module of "
        "TinyTransformer. Its modules are: embed (Linear), layers (ModuleList), layers.0 (TinyDecoderLayer)"
    )
    assert messages["too_many"] == (
        "Cannot cut TinyTransformer into 6 pipeline stages: its repeated blocks (layers) number 4. Use fewer "
        "stages (pp_size x stages_per_rank) or name the split points."
    )
    assert messages["indivisible"].startswith(
        "pipeline_step() got a batch of 6 samples, which 4 micro-batches do not divide."
    )
    assert messages["direct_call"].startswith(
        "A pipelined model (ParallelismConfig(pp_size > 1)) is not called directly for training"
    )
    assert messages["zbv_eval"].startswith(
        "Evaluation (model(inputs)) with TorchPipelineParallelConfig(schedule='zbv_zero_bubble') is not built yet"
    )


def test_pipeline_step_without_a_pipeline_says_what_to_do():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(
        RuntimeError, match=r"accelerator.pipeline_step\(\) runs a pipeline-parallel model, and this"
    ):
        accelerator.pipeline_step(nn.Linear(2, 2), torch.zeros(2, 2), target=torch.zeros(2, 2))


def test_pipeline_configuration_errors():
    with pytest.raises(
        ValueError, match=r"schedule='gpipe', stages_per_rank=2\) is invalid: this schedule runs one"
    ):
        TorchPipelineParallelConfig(schedule="gpipe", stages_per_rank=2)
    with pytest.raises(
        ValueError, match=r"zbv_zero_bubble', stages_per_rank=3\) is invalid: the ZBV schedule"
    ):
        TorchPipelineParallelConfig(schedule="zbv_zero_bubble", stages_per_rank=3)
    with pytest.raises(ValueError, match=r"num_microbatches=0\) is invalid: it must be an integer >= 1"):
        TorchPipelineParallelConfig(num_microbatches=0)
    with pytest.raises(
        NotImplementedError, match=r"ParallelismConfig\(pp_size=2, tp_size=2\) is not built yet"
    ):
        ParallelismConfig(pp_size=2, tp_size=2)
    with pytest.raises(
        NotImplementedError, match=r"dp_replicate_size=2\) is not built yet: pipeline stages are"
    ):
        ParallelismConfig(pp_size=2, dp_replicate_size=2)
    config = ParallelismConfig(pp_size=2, dp_shard_size=2)
    assert config.total_size == 4 and config.active_mesh_dims == ["pp", "dp_shard"]
    assert config.pp_handler.schedule == "1f1b" and config.to_json()["pp_handler"]["stages_per_rank"] == 1
