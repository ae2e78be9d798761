"""Expert parallelism composed with FSDP2: ``ParallelismConfig(dp_shard_size=N, ep_size=2)`` equals one process.

The tiny Qwen3-MoE of :mod:`tests.expert_parallel.test_parity` (2 layers, 8 experts, top-2, router aux loss on),
AdamW, ``accelerator.accumulate`` over 2 micro-batches, ``accelerator.clip_grad_norm_(..., 1.0)``, 10 optimizer
steps, each rank its rows of every global batch of 4 sequences, through the user's loop:

* ep=2 x dp_shard=2 on 2 processes: each rank holds half the experts (FSDP2 over a replica group of one rank)
  and half of every dense weight;
* ep=2 x dp_shard=4 on 4 processes: ep groups {0, 1} and {2, 3}; each half of the experts FSDP2-sharded over
  its replicas ({0, 2} or {1, 3}), the dense weights over all 4.

Losses (aux loss included), the clip's norms and the parameters (each rank's experts gathered over their
replicas, the dense ones over every rank) equal one process's within 1e-5. The checks of this test, a second
run in the same workers: on 2 processes the experts' gradients divided by their replica group's size (FSDP2's
default) instead of the data-parallel size, on 4 each rank's experts sharded over itself alone (no reduction
over the replicas); both must break parity (checkpoints: :mod:`tests.expert_parallel.test_fsdp_checkpoint`). The
Trainer script of :mod:`tests.expert_parallel.test_trainer` with ``{"dp_shard_size": 2, "ep_size": 2}`` equals the
Trainer on one process, in the same workers; it saves a checkpoint every 2 steps and ``save_model`` at the end, and a
second Trainer there, built from other weights, resumes from its step-2 checkpoint: bitwise the uninterrupted run
(seen failing when the load pre-hooks took the wrong experts' rows); the ``save_model`` folder loads with
``from_pretrained`` on the test's process, bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.expert_parallel._compare import differences
from tests.expert_parallel.accelerator_loop import MAX_NORM
from tests.expert_parallel.test_parity import (
    ACCUMULATION,
    ADAM_EPS,
    GLOBAL_BATCH,
    LR,
    STEPS,
    _build,
    _micro_batch,
)
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

EP_SIZE = 2
TOLERANCE = 1e-5
SAVE_STEPS = 2
BLOCK = "model.layers.0.mlp.experts"


def _train(accelerator: Any) -> dict[str, Any]:
    """The user's loop (as :func:`tests.expert_parallel.accelerator_loop.train`); the weights gathered whole,
    experts as this rank's ep shard."""
    from torch.distributed.tensor import DTensor

    from lockstep.layers.expert_parallel import expert_memory
    from lockstep.memory_accounting import account_memory

    model = _build("qwen3_moe")
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
    state = {  # every rank gathers the same tensors in the same order (full_tensor is a collective)
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in unwrapped.named_parameters()
    }
    local = {n: p.to_local().shape[0] for n, p in unwrapped.named_parameters() if isinstance(p, DTensor)}
    parts = expert_memory(unwrapped, optimizer)  # after zero_grad: parameters and moments, no gradients
    memory = {
        "all": account_memory(model, optimizer).as_dict(),
        "experts": parts.experts.as_dict(),
        "dense": parts.dense.as_dict(),
        "per_block": parts.experts_per_block,
        "rows": parts.expert_rows_per_block,
        "steps": sum(s["step"].nbytes for s in optimizer.state.values()),  # AdamW's step counters
    }
    return {
        "memory": memory,
        "rank": accelerator.process_index,
        "first": {n: m.first_expert for n, m in unwrapped.named_modules() if hasattr(m, "first_expert")},
        "losses": losses,
        "aux": aux,
        "norms": norms,
        "state": state,
        "local_rows": local,
        "distributed_type": str(accelerator.distributed_type),
    }


def _trainer(
    parallelism_config: Any, output_dir: str | None = None, resume: str | None = None
) -> dict[str, Any]:
    """The Trainer script of :mod:`tests.expert_parallel.test_trainer` (5 steps); its logged losses and norms,
    and the weights gathered as in :func:`_train`. With ``output_dir``: a checkpoint every ``SAVE_STEPS`` steps
    there and ``save_model`` into ``output_dir/final`` at the end; with ``resume``, built from other weights
    (shifted by 0.5, so that a resume that did not load cannot pass) and resumed from that checkpoint."""
    import contextlib
    import io
    import os
    import tempfile

    from torch.distributed.tensor import DTensor

    from lockstep import Trainer, TrainingArguments
    from tests.expert_parallel import test_trainer

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(),
        parallelism_config=parallelism_config,
        per_device_train_batch_size=GLOBAL_BATCH // processes,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=LR,
        adam_epsilon=ADAM_EPS,
        max_grad_norm=MAX_NORM,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no" if output_dir is None else "steps",
        save_steps=SAVE_STEPS,
        report_to="none",
        disable_tqdm=True,
    )
    model = _build("qwen3_moe")
    if resume is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)
    trainer = Trainer(model, args, train_dataset=test_trainer._dataset())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(resume_from_checkpoint=resume)
    if output_dir is not None:
        trainer.save_model(os.path.join(output_dir, "final"))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "global_step": trainer.state.global_step,
        "first": {n: m.first_expert for n, m in unwrapped.named_modules() if hasattr(m, "first_expert")},
        "state": {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            for name, param in unwrapped.named_parameters()
        },
    }


def _accelerator(dp_shard: int) -> Any:
    from lockstep import Accelerator, ParallelismConfig

    config = ParallelismConfig(dp_shard_size=dp_shard, ep_size=EP_SIZE)
    return Accelerator(gradient_accumulation_steps=ACCUMULATION, parallelism_config=config)


def _on_two(folder: str) -> dict[str, Any]:
    import os

    from lockstep.layers.expert_parallel import _layer

    result = _train(_accelerator(2))
    config = {"dp_shard_size": 2, "ep_size": EP_SIZE}
    result["trainer"] = _trainer(config, os.path.join(folder, "trainer"))
    resume = os.path.join(folder, "trainer", f"checkpoint-{SAVE_STEPS}")
    result["resumed"] = _trainer(config, os.path.join(folder, "resumed"), resume)
    # a check: the experts' gradients divided by their replica group's size (FSDP2's default), not by 2
    shard = _layer.shard_experts_apart

    def replicas_average(parallel: Any, full: Any, *, sharding: Any, mesh: Any) -> None:
        shard(parallel, full, sharding=sharding, mesh=mesh)
        for module in parallel.experts.values():
            module.set_gradient_divide_factor(float(mesh.size()))

    _layer.shard_experts_apart = replicas_average
    result["broken"] = _train(_accelerator(2))
    return result


def _on_four() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from lockstep.layers.expert_parallel import _layer

    result = _train(_accelerator(4))
    # a check: each rank's experts sharded over itself alone, so that no gradient is reduced over the replicas
    _layer.replica_mesh = lambda groups, device_type: DeviceMesh.from_group(
        dist.new_group([dist.get_rank()], use_local_synchronization=True), device_type
    )
    result["broken"] = _train(_accelerator(4))
    return result


def _one_process() -> dict[str, Any]:
    from lockstep import Accelerator

    result = _train(Accelerator(gradient_accumulation_steps=ACCUMULATION))
    result["trainer"] = _trainer(None)
    return result


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    (result,) = run_distributed(_one_process, 1, timeout=300.0)
    assert len(result["losses"]) == 20 and len(result["norms"]) == 10
    assert max(result["norms"]) > MAX_NORM  # the clip acts
    assert result["losses"][-1] < result["losses"][0] - 0.1  # it trained
    return result


@pytest.fixture(scope="module")
def two(folder: Any) -> list[dict[str, Any]]:
    return run_distributed(_on_two, 2, str(folder), timeout=300.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("fsdp_ep_trainer")


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(_on_four, 4, timeout=300.0)


def test_ep2_x_dp_shard2_on_two_processes_equals_one_process(
    one: dict[str, Any], two: list[dict[str, Any]]
) -> None:
    assert [r["distributed_type"] for r in two] == ["FSDP"] * 2
    assert [r["first"][BLOCK] for r in two] == [0, 4]
    # FSDP2 shards each dense weight over both ranks; each rank's 4 experts over its replica group of one
    assert all(r["local_rows"]["model.embed_tokens.weight"] == 32 for r in two)
    assert all(r["local_rows"][f"{BLOCK}.gate_up_proj"] == 4 for r in two)
    diff = differences(one, two)
    print(f"ep=2 x dp_shard=2 (2 processes) vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_ep2_x_dp_shard4_on_four_processes_equals_one_process(
    one: dict[str, Any], four: list[dict[str, Any]]
) -> None:
    assert [r["distributed_type"] for r in four] == ["FSDP"] * 4
    assert [r["first"][BLOCK] for r in four] == [0, 4, 0, 4]
    # dense weights over the 4 ranks; each half of the experts over its 2 replicas: 2 experts per rank
    assert all(r["local_rows"]["model.embed_tokens.weight"] == 16 for r in four)
    assert all(r["local_rows"][f"{BLOCK}.gate_up_proj"] == 2 for r in four)
    diff = differences(one, four)
    print(f"ep=2 x dp_shard=4 (4 processes) vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_experts_divided_by_their_replica_group_s_size_break_parity(
    one: dict[str, Any], two: list[dict[str, Any]]
) -> None:
    diff = differences(one, [r["broken"] for r in two])
    print(f"experts' gradients divided by the replica group's size (2 processes): {diff}")
    assert diff["norm"] > 10 * TOLERANCE and diff["params"] > 50 * TOLERANCE


def test_experts_not_reduced_over_their_replicas_break_parity(
    one: dict[str, Any], four: list[dict[str, Any]]
) -> None:
    broken = [r["broken"] for r in four]
    diff = differences(one, broken)
    replicas = max(
        (broken[r]["state"][name] - broken[r + EP_SIZE]["state"][name]).abs().max().item()
        for r in range(2)
        for name in broken[r]["state"]
        if ".experts." in name
    )
    print(f"experts not reduced over their replicas (4 processes): {diff}, replicas apart by {replicas:.3g}")
    assert diff["params"] > 50 * TOLERANCE and replicas > 50 * TOLERANCE


def test_the_trainer_with_ep2_x_dp_shard2_equals_one_process(
    one: dict[str, Any], two: list[dict[str, Any]]
) -> None:
    reference = one["trainer"]
    assert len(reference["losses"]) == len(reference["norms"]) == 5
    for rank in two:
        assert rank["trainer"]["first"][BLOCK] == rank["first"][BLOCK]
    losses = torch.tensor([r["trainer"]["losses"] for r in two])
    assert bool((losses == losses[0]).all())  # the Trainer logs the loss averaged over the processes
    diff = differences(reference, [r["trainer"] for r in two])
    print(f"Trainer, ep=2 x dp_shard=2 (2 processes) vs 1 process: {diff}")
    assert max(diff.values()) < TOLERANCE


def test_the_trainer_s_checkpoint_under_ep2_x_dp_shard2_resumes_bitwise(
    folder: Any, two: list[dict[str, Any]]
) -> None:
    import os

    trainer = folder / "trainer"
    assert sorted(p for p in os.listdir(trainer) if p.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    for rank in two:
        before, after = rank["trainer"], rank["resumed"]
        assert after["first"] == before["first"] and after["global_step"] == before["global_step"] == 5
        # steps 1-2 logged from the checkpoint's history; steps 3-5, trained from its weights (not the shifted
        # ones this run was built with), bitwise as the uninterrupted run
        assert len(after["losses"]) == 5 and after["losses"] == before["losses"]
        assert after["norms"] == before["norms"]
        assert after["state"].keys() == before["state"].keys()
        assert all(torch.equal(after["state"][n], t) for n, t in before["state"].items())


def test_the_trainer_s_save_model_under_ep2_x_dp_shard2_loads_on_one_process(
    folder: Any, two: list[dict[str, Any]]
) -> None:
    from transformers import Qwen3MoeForCausalLM

    final = Qwen3MoeForCausalLM.from_pretrained(str(folder / "trainer" / "final")).state_dict()
    # the expected whole tensors: the dense ones as gathered, the experts of ranks 0 and 1 concatenated
    ranks = [r["trainer"] for r in two]
    expected = {
        name: torch.cat([r["state"][name] for r in ranks]) if ".experts." in name else ranks[0]["state"][name]
        for name in ranks[0]["state"]
    }
    assert [r["first"][BLOCK] for r in ranks] == [0, 4]
    assert {n: t.shape for n, t in final.items() if n in expected} == {
        n: t.shape for n, t in expected.items()
    }
    assert set(final) - set(expected) <= {"lm_head.weight"}  # tied to the embeddings, if the model ties them
    assert all(torch.equal(final[n], t) for n, t in expected.items())


def test_under_ep2_x_dp_shard4_each_rank_stores_a_quarter_and_the_estimate_says_so(
    one: dict[str, Any], four: list[dict[str, Any]], tmp_path: Any
) -> None:
    """Memory with replicas: each rank's 4 experts FSDP2-sharded over its 2 replicas (2 rows stored per block),
    the dense part over all 4; ``estimate-memory --ep-size 2 --dp-shard 4`` equals the bytes (after the run's
    last ``zero_grad``: parameters and AdamW moments, step counters aside)."""
    import json

    from tests.expert_parallel.test_memory import _estimate

    folder = str(tmp_path / "qwen3_moe")
    _build("qwen3_moe").config.save_pretrained(folder)
    result = _estimate(folder, "--ep-size", "2", "--dp-shard", "4", "--json")
    assert result.returncode == 0, result.stderr
    _, ep, _ = json.loads(result.stdout)["estimates"]
    assert (ep["layout"], ep["num_processes"]) == ("dp_shard=4 x ep=2", 4)
    whole = one["memory"]
    for rank in four:
        held = rank["memory"]
        assert held["per_block"] == {"model.layers.0.mlp": 4, "model.layers.1.mlp": 4}
        assert held["rows"] == {"model.layers.0.mlp": 2, "model.layers.1.mlp": 2}
        for part in ("experts", "dense"):
            assert held[part]["parameter_bytes"] * 4 == whole[part]["parameter_bytes"], part
        assert ep["parameters"] == held["all"]["parameter_bytes"]
        assert ep["optimizer_state"] == held["all"]["optimizer_state_bytes"] - held["steps"]
    print(
        f"ep=2 x dp_shard=4 per rank: parameters + Adam moments {ep['parameters'] + ep['optimizer_state']:,} B"
    )
