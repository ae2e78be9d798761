"""The checks ``lockstep test`` runs on every worker of the configured topology.

Each check prints one line on the main process; the main process exits 1 if any failed, so the launcher
exits non-zero. Run as ``python -m lockstep.cli.selftest_worker --expected-processes N`` under a launcher.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep.accelerator import Accelerator
from lockstep.collectives import gather_object
from lockstep.rng import synchronize_rng_states


def check_ranks(accelerator: Accelerator, expected: int) -> str:
    seen = gather_object([(accelerator.process_index, socket.gethostname(), os.getpid())])
    ranks = sorted(rank for rank, _, _ in seen)
    assert ranks == list(range(expected)), f"expected ranks 0..{expected - 1}, got {ranks}"
    return f"every rank reported in ({expected} process(es) on {len({h for _, h, _ in seen})} machine(s))"


def check_ordering(accelerator: Accelerator) -> str:
    store = dist.distributed_c10d._get_default_store() if accelerator.use_distributed else None
    with accelerator.main_process_first():
        if store is not None and accelerator.is_main_process:
            store.set("lockstep_selftest/main_done", "1")
        elif store is not None:
            assert store.check(["lockstep_selftest/main_done"]), (
                "a process entered before the main process left"
            )
    return "main_process_first lets the main process go first"


def check_rng(accelerator: Accelerator) -> str:
    torch.manual_seed(1000 + accelerator.process_index)
    synchronize_rng_states(["torch"])
    draws = gather_object([torch.rand(3).tolist()])
    assert all(d == draws[0] for d in draws), f"random draws differ after synchronisation: {draws}"
    return "random number generators synchronise from rank 0"


def check_sharding(accelerator: Accelerator) -> str:
    length = 16 * accelerator.num_processes
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(length)), batch_size=4, shuffle=True))
    seen = [int(i) for (batch,) in loader for i in batch]
    everything = sorted(gather_object(seen))
    assert everything == list(range(length)), f"shards do not cover the data exactly once: {everything}"
    return f"shuffled data is split into disjoint shards covering all {length} samples"


def check_gather(accelerator: Accelerator) -> str:
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(37)), batch_size=3))
    gathered = torch.cat([accelerator.gather_for_metrics(batch) for (batch,) in loader]).tolist()
    assert gathered == list(range(37)), f"gather_for_metrics returned {gathered}"
    full = accelerator.gather(torch.tensor([accelerator.process_index]))
    assert full.tolist() == list(range(accelerator.num_processes)), f"gather returned {full.tolist()}"
    return "gather and gather_for_metrics return every sample exactly once, in order"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def check_training(accelerator: Accelerator) -> str:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(8 * 4 * accelerator.num_processes, 4, generator=generator),
        torch.randn(8 * 4 * accelerator.num_processes, 1, generator=generator),
    )
    model, optimizer = _model(), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    reference = _model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=4 * accelerator.num_processes):
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    trained = torch.cat([p.detach().reshape(-1).cpu() for p in accelerator.unwrap_model(model).parameters()])
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    difference = (trained - expected).abs().max().item()
    assert difference < 1e-5, f"parameters differ from a single process by {difference:.3g}"
    return f"training matches one process on the global batch (max difference {difference:.1e})"


CHECKS: list[tuple[str, Callable[..., str]]] = [
    ("ranks", check_ranks),
    ("ordering", check_ordering),
    ("rng", check_rng),
    ("sharding", check_sharding),
    ("gather", check_gather),
    ("training", check_training),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expected-processes", type=int, required=True)
    args = parser.parse_args()
    accelerator = Accelerator()
    accelerator.print(
        f"lockstep test: {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
        f"device {accelerator.device}, backend {accelerator.state.backend or 'none'}"
    )
    failures = 0
    for name, check in CHECKS:
        try:
            message = check(accelerator, args.expected_processes) if name == "ranks" else check(accelerator)
            accelerator.print(f"  [ok]   {message}")
        except AssertionError as error:
            failures += 1
            accelerator.print(f"  [FAIL] {name}: {error}")
    accelerator.print(f"lockstep test: {len(CHECKS) - failures} passed, {failures} failed")
    accelerator.end_training()
    if failures and accelerator.is_main_process:
        sys.exit(1)


if __name__ == "__main__":
    main()
