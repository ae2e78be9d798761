"""N-D parallelism (``ParallelismConfig``): tensor parallel, dp x tp and HSDP on real gloo groups, each against
one process on the global batch.

Tolerance: SGD runs match one process within 1e-6 (measured: 0 to 2.4e-7; float reordering of the sharded
matmuls and reductions is the only difference).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lockstep import Accelerator, ParallelismConfig
from lockstep.config.parallelism import TorchTensorParallelConfig
from tests.helpers.fsdp_models import data_loader, full_params, loss_of, make_transformer, reference_run
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

LENGTH, PER_REPLICA = 48, 8
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
TOLERANCE = 1e-6


def _accelerator(sizes: dict, **kwargs) -> Accelerator:
    handler = TorchTensorParallelConfig(parallelize_plan=PLAN) if sizes.get("tp_size", 1) > 1 else None
    return Accelerator(parallelism_config=ParallelismConfig(**sizes, tp_handler=handler), **kwargs)


def _train(sizes: dict, options: dict) -> dict:
    accelerator = _accelerator(sizes)
    model = make_transformer()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=options.get("lr", 0.1)
    )  # built before prepare: re-bound
    batch_size = options.get("batch_size", PER_REPLICA)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, batch_size))
    if "divide_factor" in options:
        for module in model.modules():  # FSDP2 reduces with PREMUL_SUM for such a factor
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(options["divide_factor"])
    norms, first_samples = [], []
    for _ in range(2):
        for x, y in train_dl:
            first_samples.append(round(float(x[0, 0]), 6))
            accelerator.backward(loss_of(model, (x, y)))
            if options.get("clip"):
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), options["clip"])))
            optimizer.step()
            optimizer.zero_grad()
    up = model.layers[0].up.weight
    return {
        "params": full_params(model),
        "norms": norms,
        "samples": first_samples,
        "mesh": accelerator.torch_device_mesh.mesh_dim_names,
        "ranks": (
            accelerator.data_parallel_rank,
            accelerator.data_parallel_shard_rank,
            accelerator.tensor_parallel_rank,
        ),
        "up_placements": [repr(p) for p in up.placements] if isinstance(up, DTensor) else None,
        "distributed_type": str(accelerator.distributed_type),
        "state_mesh": accelerator.state.device_mesh is accelerator.torch_device_mesh,
    }


def _max_diff(result: dict, expected: torch.Tensor) -> float:
    return (result["params"] - expected).abs().max().item()


@pytest.mark.distributed
def test_tensor_parallel_on_two_processes_matches_one_process_and_clips_the_global_norm():
    results = run_distributed(_train, 2, {"tp_size": 2}, {"clip": 0.5})
    expected, norms = reference_run(LENGTH, PER_REPLICA, clip=0.5)
    for rank, result in enumerate(results):
        assert result["mesh"] == ("tp",) and result["state_mesh"]
        assert result["ranks"] == (0, 0, rank)
        assert result["up_placements"] == ["Shard(dim=0)"]  # colwise: the output features are split
        assert _max_diff(result, expected) <= TOLERANCE
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
    # one tensor-parallel group: both processes read the same batches
    assert (
        results[0]["samples"] == results[1]["samples"]
        and len(results[0]["samples"]) == 2 * LENGTH // PER_REPLICA
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_dp_shard_by_tp_on_four_processes_matches_one_process():
    results = run_distributed(_train, 4, {"dp_shard_size": 2, "tp_size": 2}, {"clip": 0.5}, timeout=180)
    expected, norms = reference_run(LENGTH, 2 * PER_REPLICA, clip=0.5)
    for rank, result in enumerate(results):
        assert result["mesh"] == ("dp_shard", "tp")
        assert result["ranks"] == (0, rank // 2, rank % 2)
        # FSDP over dp_shard on top of the colwise split over tp: a 2-D DTensor (dim 0 split twice)
        assert result["up_placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert result["distributed_type"] == "FSDP"
        assert _max_diff(result, expected) <= TOLERANCE
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
    # processes 0,1 (tp group of dp rank 0) share batches; 0 and 2 (different dp ranks) do not
    assert results[0]["samples"] == results[1]["samples"]
    assert results[2]["samples"] == results[3]["samples"]
    assert results[0]["samples"] != results[2]["samples"]


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_on_four_processes_matches_one_process():
    # 4 replicas x 4 samples: the global batch of 16 divides the 48 samples
    results = run_distributed(
        _train, 4, {"dp_replicate_size": 2, "dp_shard_size": 2}, {"batch_size": 4}, timeout=180
    )
    expected, _ = reference_run(LENGTH, 16)
    for rank, result in enumerate(results):
        assert result["mesh"] == ("dp_replicate", "dp_shard")
        assert result["ranks"] == (rank // 2, rank % 2, 0)
        assert _max_diff(result, expected) <= TOLERANCE
    assert len({tuple(r["samples"]) for r in results}) == 4  # four replicas, four different shares


@pytest.mark.distributed
def test_a_gradient_divide_factor_works_on_gloo_without_premul_sum():
    # FSDP2 reduces with ReduceOp.PREMUL_SUM(1/factor) for a factor other than the group size, which gloo
    # lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); the backend makes it sum and divide apart.
    # Dividing the summed gradients of 2 processes by 4 halves the mean: the same as SGD at half the rate.
    results = run_distributed(_train, 2, {"dp_shard_size": 2}, {"divide_factor": 4.0})
    expected, _ = reference_run(LENGTH, 2 * PER_REPLICA, lr=0.05)
    assert _max_diff(results[0], expected) <= TOLERANCE


def _save_and_reload(sizes: dict, folder: str) -> dict:
    accelerator = _accelerator(sizes)
    model = make_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_REPLICA))
    batches = list(train_dl)
    for batch in batches[:2]:
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(folder)
    saved = full_params(model)
    full = accelerator.get_state_dict(model)
    for batch in batches[2:4]:  # train on, then go back to the checkpoint
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    moved = full_params(model)
    accelerator.load_state(folder)
    restored = full_params(model)
    for batch in batches[2:4]:  # the same two steps again: exact resume
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "saved": saved,
        "moved": moved,
        "restored": restored,
        "again": full_params(model),
        "full_keys": sorted(full),
        "full_shapes": {k: tuple(v.shape) for k, v in full.items()},
        "plain": all(not isinstance(v, DTensor) for v in full.values()),
    }


@pytest.mark.distributed
def test_tensor_parallel_checkpoint_round_trip_and_full_state_dict(tmp_path):
    results = run_distributed(_save_and_reload, 2, {"tp_size": 2}, str(tmp_path / "ckpt"))
    reference = make_transformer()
    for rank, result in enumerate(results):
        assert not torch.equal(result["moved"], result["saved"])
        assert torch.equal(result["restored"], result["saved"])
        assert torch.equal(result["again"], result["moved"])  # optimizer state restored too
        if rank == 0:
            assert result["plain"]
            assert result["full_keys"] == sorted(reference.state_dict())
            assert result["full_shapes"] == {k: tuple(v.shape) for k, v in reference.state_dict().items()}


def _error_before_training() -> str:
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    try:
        accelerator.prepare(make_transformer())
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_a_model_without_a_plan_fails_before_training():
    # context parallelism's refusals (a model without SDPA...) are tests/backends/test_context_parallel.py's
    message = run_distributed(_error_before_training, 2)[0]
    assert message.startswith(
        "ParallelismConfig(tp_size=2) needs a tensor-parallel plan for TinyTransformer: pass ParallelismConfig("
        "tp_handler=TorchTensorParallelConfig(parallelize_plan="
    )


def _tiny_llama(path: str) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)


def _train_llama(path: str, tp_size: int) -> dict:
    from transformers import LlamaForCausalLM

    sizes = {"tp_size": tp_size} if tp_size > 1 else {}
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes) if sizes else None)
    model = LlamaForCausalLM.from_pretrained(path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(float(loss.detach()))
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    return {
        "losses": losses,
        "norms": norms,
        "params": full_params(model),
        "q_proj": [repr(p) for p in q_proj.placements] if isinstance(q_proj, DTensor) else None,
    }


@requires("transformers")
@pytest.mark.distributed
def test_a_transformers_llama_is_split_by_its_own_tp_plan_and_matches_one_process(tmp_path):
    path = str(tmp_path / "tiny-llama")
    _tiny_llama(path)
    expected = run_distributed(_train_llama, 1, path, 1)[0]
    results = run_distributed(_train_llama, 2, path, 2, timeout=180)
    for result in results:
        assert result["q_proj"] == ["Shard(dim=0)"]  # base_model_tp_plan: q_proj is colwise
        assert result["losses"] == pytest.approx(expected["losses"], abs=1e-6)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5)
        assert (result["params"] - expected["params"]).abs().max().item() <= TOLERANCE


def _evaluate(sizes: dict) -> dict:
    """Evaluate 10 samples (batches of 4: the last global batch is short) and gather per-sample values."""
    from torch.utils.data import DataLoader

    accelerator = _accelerator(sizes)
    model = accelerator.prepare(make_transformer())
    ids = torch.arange(10, dtype=torch.float32)
    features = torch.stack([ids] * 8, dim=1)
    eval_dl = accelerator.prepare(DataLoader(torch.utils.data.TensorDataset(features), batch_size=4))
    gathered, objects, count, loss_sum = [], [], torch.tensor(0), torch.tensor(0.0)
    with torch.no_grad():
        for (x,) in eval_dl:
            prediction = model(x).squeeze(-1)
            sample_ids = x[:, 0]
            ids_now, prediction = accelerator.gather_for_metrics((sample_ids, prediction))
            gathered.append((ids_now, prediction))
            objects += accelerator.gather_for_metrics([int(i) for i in sample_ids], use_gather_object=True)
            count += len(sample_ids)
            loss_sum += prediction.sum()
    # a DTensor (a column-sharded activation on the tp mesh) is made whole before it is gathered
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = accelerator.torch_device_mesh["tp"]
    sharded = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(1)])
    return {
        "ids": torch.cat([g[0] for g in gathered]).tolist(),
        "predictions": torch.cat([g[1] for g in gathered]),
        "objects": objects,
        "summed_count": int(accelerator.reduce(count, reduction="sum")),
        "mean_count": float(accelerator.reduce(count.float(), reduction="mean")),
        "dtensor": accelerator.gather_for_metrics(sharded).tolist(),
    }


def _single_predictions() -> torch.Tensor:
    ids = torch.arange(10, dtype=torch.float32)
    with torch.no_grad():
        return make_transformer()(torch.stack([ids] * 8, dim=1)).squeeze(-1)


@pytest.mark.distributed
def test_gather_for_metrics_and_reduce_count_each_sample_once_under_tensor_parallel():
    results = run_distributed(_evaluate, 2, {"tp_size": 2})
    expected = _single_predictions()
    for result in results:
        # one data-parallel replica: every sample once, in order (not once per tp rank)
        assert result["ids"] == list(range(10))
        assert result["objects"] == list(range(10))
        assert (result["predictions"] - expected).abs().max().item() <= TOLERANCE
        assert result["summed_count"] == 10  # not 20: the two tp ranks saw the same samples
        assert result["mean_count"] == 10.0
        assert result["dtensor"] == torch.arange(8.0).reshape(2, 4).tolist()


@pytest.mark.distributed
@pytest.mark.slow
def test_gather_for_metrics_and_reduce_over_the_data_parallel_replicas_of_dp_by_tp():
    results = run_distributed(_evaluate, 4, {"dp_shard_size": 2, "tp_size": 2}, timeout=180)
    expected = _single_predictions()
    for result in results:
        # two replicas (batches of 4 each, 8 per global batch): 10 samples once each, in dataset order
        assert result["ids"] == list(range(10))
        assert result["objects"] == list(range(10))
        assert (result["predictions"] - expected).abs().max().item() <= TOLERANCE
        # 2 global batches of 8 (the last one evened out with repeated samples), not 32 (once per tp rank)
        assert result["summed_count"] == 16
        assert result["dtensor"] == 2 * torch.arange(8.0).reshape(2, 4).tolist()  # one per replica


def _steps(accelerator: Accelerator, model, optimizer, batches) -> None:
    for batch in batches:
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        optimizer.zero_grad()


def _save_then_train_on(sizes: dict, batch_size: int, folder: str) -> dict:
    """Two AdamW steps, save_state, two more steps: the parameters at the save and at the end."""
    accelerator = _accelerator(sizes)
    model = make_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, batch_size))
    batches = list(train_dl)
    _steps(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(folder)
    saved = full_params(model)
    _steps(accelerator, model, optimizer, batches[2:4])
    return {"saved": saved, "end": full_params(model)}


def _load_on_another_layout(sizes: dict | None, batch_size: int, folder: str) -> dict:
    """Load the checkpoint into another layout (None: FSDP on one process), then the same two steps."""
    from lockstep.utils import FullyShardedDataParallelPlugin

    if sizes is None:
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    else:
        accelerator = _accelerator(sizes)
    model = make_transformer(seed=5)  # other weights: everything must come from the checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, batch_size))
    batches = list(train_dl)
    accelerator.load_state(folder)
    loaded = full_params(model)
    _steps(accelerator, model, optimizer, batches[2:4])
    return {"loaded": loaded, "end": full_params(model)}


RESHARD_WARNINGS = pytest.mark.filterwarnings("ignore:The dataloader state was saved with")


@RESHARD_WARNINGS
@pytest.mark.distributed
def test_a_tp2_checkpoint_loads_into_fsdp_and_one_process_and_trains_on(tmp_path):
    # AdamW state (step, both moments) is resharded too: the next two steps match the tp=2 run's
    folder = str(tmp_path / "tp2")
    reference = run_distributed(_save_then_train_on, 2, {"tp_size": 2}, PER_REPLICA, folder)[0]
    for sizes, processes, batch_size in (({"dp_shard_size": 2}, 2, PER_REPLICA // 2), (None, 1, PER_REPLICA)):
        result = run_distributed(_load_on_another_layout, processes, sizes, batch_size, folder)[0]
        assert torch.equal(result["loaded"], reference["saved"])
        assert (result["end"] - reference["end"]).abs().max().item() <= 1e-5
    # merge-weights assembles the tp-split shards into one full safetensors model, no process group needed
    from safetensors.torch import load_file

    from tests.helpers.cli import lockstep_in_process

    merged = lockstep_in_process("merge-weights", folder, str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr
    weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    reference_model = make_transformer()
    assert sorted(weights) == sorted(reference_model.state_dict())
    flat = torch.cat([weights[name].reshape(-1) for name, _ in reference_model.named_parameters()])
    assert torch.equal(flat, reference["saved"])


@RESHARD_WARNINGS
@pytest.mark.distributed
@pytest.mark.slow
def test_a_dp2_by_tp2_checkpoint_loads_into_dp_shard_4(tmp_path):
    folder = str(tmp_path / "dp2tp2")
    reference = run_distributed(
        _save_then_train_on, 4, {"dp_shard_size": 2, "tp_size": 2}, PER_REPLICA, folder, timeout=180
    )[0]
    result = run_distributed(
        _load_on_another_layout, 4, {"dp_shard_size": 4}, PER_REPLICA // 2, folder, timeout=180
    )[0]
    assert torch.equal(result["loaded"], reference["saved"])
    assert (result["end"] - reference["end"]).abs().max().item() <= 1e-5


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(torch.tanh(self.up(h))))


def _train_with_loss_parallel(tp_size: int) -> dict:
    """The LM head split over the vocabulary (its logits stay a DTensor) and the loss computed on the shards
    by torch's loss_parallel, against plain cross-entropy on one process; AdamW with accumulation 2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

    plan = {"up": "colwise", "down": "rowwise", "head": ColwiseParallel(use_local_output=False)}
    config = (
        ParallelismConfig(tp_size=tp_size, tp_handler=TorchTensorParallelConfig(parallelize_plan=plan))
        if tp_size > 1
        else None
    )
    accelerator = Accelerator(parallelism_config=config, gradient_accumulation_steps=2)
    model = _TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses, placements = [], None
    for _ in range(6):
        ids = torch.randint(0, 64, (4, 8), generator=generator)
        with accelerator.accumulate(model):
            logits = model(ids)
            if isinstance(logits, DTensor):
                placements = [repr(p) for p in logits.placements]
            with loss_parallel() if tp_size > 1 else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
    return {"losses": losses, "params": full_params(model), "logits_placements": placements}


@pytest.mark.distributed
def test_loss_parallel_on_a_vocabulary_sharded_head_matches_one_process():
    expected = run_distributed(_train_with_loss_parallel, 1, 1)[0]
    for result in run_distributed(_train_with_loss_parallel, 2, 2):
        assert result["logits_placements"] == ["Shard(dim=2)"]  # never gathered whole
        assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
        assert (result["params"] - expected["params"]).abs().max().item() <= 1e-5


@pytest.mark.distributed
def test_a_tp2_run_resumes_exactly_in_a_fresh_process_group(tmp_path):
    # one run: two AdamW steps, save_state, two more; another process group (new processes, new tp mesh,
    # other initial weights) loads the checkpoint and takes the same two steps: bitwise the same weights
    folder = str(tmp_path / "tp2")
    uninterrupted = run_distributed(_save_then_train_on, 2, {"tp_size": 2}, PER_REPLICA, folder)
    resumed = run_distributed(_load_on_another_layout, 2, {"tp_size": 2}, PER_REPLICA, folder)
    for rank in range(2):
        assert not torch.equal(resumed[rank]["end"], resumed[rank]["loaded"])
        assert torch.equal(resumed[rank]["loaded"], uninterrupted[rank]["saved"])
        assert torch.equal(resumed[rank]["end"], uninterrupted[rank]["end"])


ACCUMULATION_LENGTH, ACCUMULATION = 64, 2


def _train_accumulating(sizes: dict, batch_size: int) -> dict:
    """AdamW with accumulation 2 through the plain Accelerator loop; the loss of each global micro-batch."""
    accelerator = _accelerator(sizes, gradient_accumulation_steps=ACCUMULATION)
    model = make_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(
        model, optimizer, data_loader(ACCUMULATION_LENGTH, batch_size)
    )
    losses = []
    for _ in range(2):
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = loss_of(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return {"params": full_params(model), "losses": losses}


def _reference_accumulating(global_micro_batch: int) -> tuple[torch.Tensor, list[float]]:
    """One process, plain PyTorch, AdamW on global micro-batches, stepping every ACCUMULATION of them."""
    model = make_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = list(data_loader(ACCUMULATION_LENGTH, global_micro_batch))
    losses = []
    for _ in range(2):
        for index, batch in enumerate(batches):
            loss = loss_of(model, batch)
            (loss / ACCUMULATION).backward()
            losses.append(loss.item())
            if (index + 1) % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_with_adamw_and_accumulation_matches_one_process():
    # 2 replicas x 2 shards, 4 samples each: global micro-batches of 16, an optimizer step every 32 samples
    results = run_distributed(
        _train_accumulating, 4, {"dp_replicate_size": 2, "dp_shard_size": 2}, 4, timeout=180
    )
    expected, losses = _reference_accumulating(16)
    assert len(losses) == 2 * ACCUMULATION_LENGTH // 16
    for result in results:
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
        assert _max_diff(result, expected) <= 1e-5
