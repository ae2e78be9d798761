"""Measures of gpu_check.sh beside the step times (issue 29, item 7): checkpoint save and load through
lockstep against hand-written ``torch.save``/``torch.load`` of GPU-resident state, and the activation memory
each activation policy keeps on the device.

Device-agnostic: the GPU machine runs it on CUDA (``torch.cuda.max_memory_allocated`` gives the peaks); the
test that keeps this file working runs it on the CPU with tiny sizes (the peaks are then None).
"""

from __future__ import annotations

import functools
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lockstep import Accelerator
from lockstep.memory.activation_meter import KeptActivations
from lockstep.memory.activation_policy import apply_activation_policy, parse_activation_policy

POLICIES = ("none", "full", "every_2", "op", "offload")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _timed(device: torch.device, function: Callable[[], object]) -> float:
    _sync(device)
    _barrier()
    started = time.perf_counter()
    function()
    _sync(device)
    _barrier()
    return time.perf_counter() - started


# -- checkpoints -------------------------------------------------------------------------------------------
def _linear_stack(device: torch.device, width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int, device: torch.device) -> None:
    model(torch.randn(2, width, device=device)).sum().backward()
    optimizer.step()  # creates AdamW's moment buffers
    optimizer.zero_grad()


def checkpoint_figures(device: torch.device, root: Path, *, width: int, layers: int, repeats: int) -> dict:
    """Seconds of a save and of a load (every rank together; hand-written: rank 0 saves, every rank loads
    onto its device), lockstep's asynchronous-save stall, in interleaved ABBA blocks; and the ratios."""
    accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer = _linear_stack(device, width, layers)
    model, optimizer = accelerator.prepare(model, optimizer)
    _one_step(model, optimizer, width, device)
    hand_model, hand_optimizer = _linear_stack(device, width, layers)
    _one_step(hand_model, hand_optimizer, width, device)

    def hand_save(folder: Path) -> None:
        if _rank() == 0:
            folder.mkdir(parents=True)
            state = {"model": hand_model.state_dict(), "optimizer": hand_optimizer.state_dict()}
            torch.save(state, folder / "checkpoint.pt")

    def hand_load(folder: Path) -> None:
        state = torch.load(folder / "checkpoint.pt", map_location=device, weights_only=True)
        hand_model.load_state_dict(state["model"])
        hand_optimizer.load_state_dict(state["optimizer"])

    tools = {
        "torch": (hand_save, hand_load),
        "lockstep": (lambda f: accelerator.save_state(str(f)), lambda f: accelerator.load_state(str(f))),
    }
    seconds: dict[str, dict[str, list[float]]] = {"save": {}, "load": {}}
    stalls: list[float] = []
    for block in range(2 * repeats):
        for tool in ("torch", "lockstep") if block % 2 == 0 else ("lockstep", "torch"):
            save, load = tools[tool]
            folder = root / f"{tool}_{block}"
            seconds["save"].setdefault(tool, []).append(_timed(device, functools.partial(save, folder)))
            accelerator.wait_for_everyone()  # lockstep's background commit, untimed
            seconds["load"].setdefault(tool, []).append(_timed(device, functools.partial(load, folder)))
            _barrier()
            if _rank() == 0:
                shutil.rmtree(folder)
        folder = root / f"async_{block}"
        stalls.append(_timed(device, functools.partial(accelerator.save_state, str(folder), async_save=True)))
        accelerator.wait_for_checkpoint()
        _barrier()
        if _rank() == 0:
            shutil.rmtree(folder)
    ratios = {
        name: statistics.median(lo / ha for lo, ha in zip(times["lockstep"], times["torch"]))
        for name, times in seconds.items()
    }
    parameters = sum(p.numel() for p in hand_model.parameters())
    return {
        "parameters": parameters,
        "seconds": seconds,
        "ratio_to_hand_written": ratios,
        "async_stall_seconds": stalls,
    }


# -- activation memory -------------------------------------------------------------------------------------
class Block(nn.Module):
    """One pre-norm transformer block: the unit every policy wraps."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _transformer(device: torch.device, dim: int, depth: int, vocab: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, dim),
        *[Block(dim, max(1, dim // 64)) for _ in range(depth)],
        nn.Linear(dim, vocab),
    ).to(device)


def activation_figures(
    device: torch.device, *, dim: int, depth: int, vocab: int, batch: int, seq: int, steps: int
) -> list[dict]:
    """For each policy: the bytes the forward keeps for backward (lockstep's meter, and on CUDA the
    allocator's growth over the forward), the allocator's peak over forward and backward, and the time of
    a forward and backward."""
    tokens = torch.randint(
        0, vocab, (batch, seq), device=device, generator=torch.Generator(device=device).manual_seed(0)
    )
    rows = []
    for policy in POLICIES:
        model = _transformer(device, dim, depth, vocab)
        blocks = [module for module in model if isinstance(module, Block)]
        apply_activation_policy(model, blocks, parse_activation_policy(policy, owner="gpu_check"))
        rows.append({"policy": policy, **_policy_figures(model, tokens, steps)})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _policy_figures(model: nn.Module, tokens: torch.Tensor, steps: int) -> dict:
    device = tokens.device
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def forward() -> torch.Tensor:
        with autocast:
            return model(tokens).float().square().mean()

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with KeptActivations(exclude=[*model.parameters(), *model.buffers()]) as meter:
        loss = forward()
    kept = meter.kept_bytes()  # while the graph is alive
    grown = torch.cuda.memory_allocated(device) - before if cuda else None
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    del loss

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward().backward()

    times = [_timed(device, step) for _ in range(steps)]
    return {
        "kept_bytes_meter": kept,
        "forward_growth_bytes": grown,
        "peak_over_step_bytes": peak,
        "step_ms": statistics.median(times) * 1e3,
    }


def print_memory_io(checkpoint: dict, activations: list[dict]) -> None:
    """The figures of this module as gpu_check.sh prints them."""
    ratios = checkpoint["ratio_to_hand_written"]
    print(
        f"checkpoint ({checkpoint['parameters'] / 1e6:.0f}M parameters + AdamW): save {ratios['save']:.3f}, "
        f"load {ratios['load']:.3f} of hand-written torch.save/torch.load; async-save stall "
        f"{statistics.median(checkpoint['async_stall_seconds']) * 1e3:.0f} ms"
    )
    mib = 2.0**20
    for row in activations:
        growth = row["forward_growth_bytes"]
        peak = row["peak_over_step_bytes"]
        print(
            f"activations {row['policy']:>8}: meter {row['kept_bytes_meter'] / mib:.0f} MiB, "
            f"allocator growth {'-' if growth is None else f'{growth / mib:.0f} MiB'}, "
            f"peak {'-' if peak is None else f'{peak / mib:.0f} MiB'}, step {row['step_ms']:.1f} ms"
        )
