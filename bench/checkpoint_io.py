"""Checkpoint costs: save and load throughput, the training stall of an async save, resume time.

    .venv/bin/python bench/checkpoint_io.py [--params-millions 25]

Prints MB/s for save_state and load_state of a model with Adam state (about 12 bytes per parameter on
disk), beside ``dd`` reading the same files from the page cache and from the disk (the physical limits);
the stall of a synchronous save, of a ``durable="background"`` save (folder final, fsync in the
background) and of an asynchronous save; and the time from load_state_dict to the first batch when
resuming a 1,000,000-sample shuffled loader at batch 10 and at batch 100,000.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lockstep import Accelerator


class Indices(Dataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(params_millions: float) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, round(params_millions * 1e6 / (width * width)))
    accelerator = Accelerator()
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # creates Adam's moment buffers
    optimizer.zero_grad()
    return accelerator, model, optimizer


def dd_read_seconds(folder: Path, direct: bool) -> float | None:
    """Seconds ``dd`` takes to read every file of ``folder`` (4 MiB blocks): from the page cache (the files
    were just written, so the bytes are in memory: the limit of a load on a warm machine), or with
    ``iflag=direct`` from the disk itself (the limit of a cold load). None where direct reads are refused
    (tmpfs, some overlay filesystems)."""
    started = time.perf_counter()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        command = ["dd", f"if={path}", "of=/dev/null", "bs=4M", *(["iflag=direct"] if direct else [])]
        if subprocess.run(command, capture_output=True).returncode != 0:
            return None
    return time.perf_counter() - started


def time_saves(accelerator: Accelerator, root: Path, repeats: int) -> dict[str, float]:
    sync, background, async_stall, load, dd_cached, dd_disk = [], [], [], [], [], []
    size = 0
    for i in range(repeats):
        folder = root / f"sync_{i}"
        started = time.perf_counter()
        accelerator.save_state(str(folder), durable="sync")
        sync.append(time.perf_counter() - started)
        size = folder_bytes(folder)
        started = time.perf_counter()
        accelerator.load_state(str(folder))
        load.append(time.perf_counter() - started)
        dd_cached.append(dd_read_seconds(folder, direct=False))
        dd_disk.append(dd_read_seconds(folder, direct=True))
        started = time.perf_counter()
        accelerator.save_state(str(root / f"background_{i}"), durable="background")
        background.append(time.perf_counter() - started)
        accelerator.wait_for_checkpoint()
        accelerator.save_state(str(root / f"async_{i}"), async_save=True)
        async_stall.append(accelerator.last_save_report.stall_seconds)
        accelerator.wait_for_checkpoint()
        for name in (folder.name, f"background_{i}", f"async_{i}"):
            shutil.rmtree(root / name)
    mb = size / 1e6
    return {
        "mb": mb,
        "save": statistics.median(sync),
        "background": statistics.median(background),
        "load": statistics.median(load),
        "async_stall": statistics.median(async_stall),
        "dd_cached": statistics.median(dd_cached),
        "dd_disk": None if None in dd_disk else statistics.median(dd_disk),
    }


def time_resume(accelerator: Accelerator, position: int) -> float:
    loader = accelerator.prepare(DataLoader(Indices(1_000_000), batch_size=8, shuffle=True))
    state = loader.state_dict()
    state["batches_yielded"] = position
    started = time.perf_counter()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator, _, _ = build(args.params_millions)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        figures = time_saves(accelerator, Path(tmp), args.repeats)
    print(
        f"checkpoint of {figures['mb']:.0f} MB ({args.params_millions:.0f}M parameters + Adam state), "
        f"median of {args.repeats}:"
    )
    print(
        f"  save_state  {figures['save']:.2f} s  ({figures['mb'] / figures['save']:.0f} MB/s, manifest checksums included)"
    )
    print(
        f"  load_state  {figures['load']:.2f} s  ({figures['mb'] / figures['load']:.0f} MB/s, checksums verified)"
    )
    disk = figures["dd_disk"]
    print(
        f"  dd reading the same files: {figures['mb'] / figures['dd_cached']:.0f} MB/s from the page cache, "
        + (
            f"{figures['mb'] / disk:.0f} MB/s from the disk (iflag=direct)"
            if disk
            else "direct reads refused here"
        )
    )
    print(
        f"  training stall: synchronous {figures['save']:.2f} s, durable='background' {figures['background']:.2f} s "
        f"({figures['background'] / figures['save']:.0%}), asynchronous {figures['async_stall']:.2f} s "
        f"({figures['async_stall'] / figures['save']:.0%} of the synchronous save)"
    )
    for position in (10, 100_000):
        seconds = statistics.median(time_resume(accelerator, position) for _ in range(3))
        print(
            f"  resume a 1,000,000-sample shuffled loader at batch {position:,}: {seconds * 1e3:.1f} ms to the first batch"
        )


if __name__ == "__main__":
    main()
