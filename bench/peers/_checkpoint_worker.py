"""Worker of run.py (one process): checkpoint throughput, resume time, and mid-epoch resume correctness.

    python bench/peers/_checkpoint_worker.py io --params-millions 25 --repeats 3
    python bench/peers/_checkpoint_worker.py resume-time --repeats 3
    python bench/peers/_checkpoint_worker.py train --tool T --out W.pt [--stop-at N --save DIR | --resume DIR]

Each tool saves and loads as its documentation shows: hand-written ``torch.save``/``torch.load`` of the
state dicts (and ``torch.distributed.checkpoint.async_save`` for the asynchronous save); lockstep and
Accelerate ``save_state``/``load_state`` (lockstep's ``async_save=True``; Accelerate has none); Fabric
``fabric.save``/``fabric.load`` of a state dict holding the model and optimizer (Fabric has no
asynchronous save). ``io`` and ``resume-time`` print one JSON line; ``train`` writes the final weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

import _tools
import torch
from checkpoint_io import Indices, folder_bytes
from harness import TOOLS, abba_order
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

torch.set_num_threads(1)
RESUME_BATCH = 8


class ResumableRandomSampler(Sampler[int]):
    """The hand-written resumable sampler: a permutation drawn from ``seed + epoch``, started at ``start``."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length, self.seed, self.epoch, self.start = length, seed, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.length - self.start

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=generator)[self.start :]
        self.start = 0  # the next epoch starts at its beginning
        return iter(order.tolist())


# -- save and load ---------------------------------------------------------------------------------------
class Checkpointer:
    """One tool's save, asynchronous save (None where the tool has none) and load of a model + Adam."""

    def __init__(self, tool: str, params_millions: float) -> None:
        self.tool = tool
        width = 1024
        layers = max(1, round(params_millions * 1e6 / (width * width)))
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        if tool in ("lockstep", "accelerate"):
            self.accelerator = (
                _tools.lockstep_accelerator(False)
                if tool == "lockstep"
                else _tools.accelerate_accelerator(False)
            )
            model, optimizer = self.accelerator.prepare(model, optimizer)
        elif tool == "fabric":
            self.fabric = _tools.fabric(False, 1)
            model, optimizer = self.fabric.setup(model, optimizer)
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()  # creates Adam's moment buffers
        optimizer.zero_grad()
        self.model, self.optimizer = model, optimizer
        self.has_async = tool in ("torch", "lockstep")

    def save(self, folder: Path) -> None:
        if self.tool == "torch":
            folder.mkdir()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, folder / "checkpoint.pt")
        elif self.tool == "fabric":
            self.fabric.save(folder / "checkpoint.ckpt", {"model": self.model, "optimizer": self.optimizer})
        else:
            self.accelerator.save_state(str(folder))

    def settle(self) -> None:
        """Untimed, between a save and its load: lockstep's save returns with the checkpoint folder final
        (files, checksums of the bytes written, manifest) and fsyncs it on a thread while training goes on;
        wait for that here so that the timed load does not include it. The other tools fsync nothing and
        have nothing in flight."""
        if self.tool == "lockstep":
            self.accelerator.wait_for_checkpoint()

    def save_async(self, folder: Path):
        """Start an asynchronous save; returns what :meth:`wait` needs."""
        if self.tool == "torch":
            import torch.distributed.checkpoint as dcp

            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            return dcp.async_save(state, checkpoint_id=str(folder))
        return self.accelerator.save_state(str(folder), async_save=True)

    def wait(self, pending) -> None:
        if self.tool == "torch":
            pending.result()
        else:
            self.accelerator.wait_for_checkpoint()

    def load(self, folder: Path) -> None:
        if self.tool == "torch":
            state = torch.load(folder / "checkpoint.pt", weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        elif self.tool == "fabric":
            self.fabric.load(folder / "checkpoint.ckpt", {"model": self.model, "optimizer": self.optimizer})
        else:
            self.accelerator.load_state(str(folder))


def _timed(function, *args) -> tuple[float, object]:
    started = time.perf_counter()
    value = function(*args)
    return time.perf_counter() - started, value


def measure_io(params_millions: float, repeats: int, root: Path) -> dict:
    tools = {tool: Checkpointer(tool, params_millions) for tool in TOOLS}
    figures = {name: {tool: [] for tool in TOOLS} for name in ("save", "load", "async_stall")}
    sizes = {}
    for block, order in enumerate(abba_order(TOOLS, repeats)):
        for tool in order:
            checkpointer, folder = tools[tool], root / f"{tool}_{block}"
            figures["save"][tool].append(_timed(checkpointer.save, folder)[0])
            checkpointer.settle()
            sizes[tool] = folder_bytes(folder)
            figures["load"][tool].append(_timed(checkpointer.load, folder)[0])
            shutil.rmtree(folder)
            if checkpointer.has_async:
                stall, pending = _timed(checkpointer.save_async, root / f"{tool}_{block}_async")
                checkpointer.wait(pending)
                figures["async_stall"][tool].append(stall)
                shutil.rmtree(root / f"{tool}_{block}_async")
    return {"seconds": figures, "bytes": sizes}


# -- resume time -----------------------------------------------------------------------------------------
def _resume_time(tool: str, loader: DataLoader, position: int) -> float:
    """Seconds from the start of each tool's documented mid-epoch resume to the first batch."""
    started = time.perf_counter()
    if tool == "torch":
        loader.sampler.set_epoch(0, start=position * RESUME_BATCH)
        next(iter(loader))
    elif tool == "lockstep":  # what load_state does with the saved position
        state = loader.state_dict()
        state["batches_yielded"] = position
        loader.load_state_dict(state)
        next(iter(loader))
    elif tool == "accelerate":
        next(iter(_tools.accelerate_accelerator(False).skip_first_batches(loader, position)))
    else:  # Fabric documents no mid-epoch resume: the loop iterates past the batches it already saw
        next(itertools.islice(iter(loader), position, None))
    return time.perf_counter() - started


def measure_resume_time(repeats: int) -> dict:
    dataset = Indices(1_000_000)
    loaders = {
        "torch": DataLoader(dataset, batch_size=RESUME_BATCH, sampler=ResumableRandomSampler(len(dataset))),
        "lockstep": _tools.lockstep_accelerator(False).prepare(
            DataLoader(dataset, batch_size=RESUME_BATCH, shuffle=True)
        ),
        "accelerate": _tools.accelerate_accelerator(False).prepare(
            DataLoader(dataset, batch_size=RESUME_BATCH, shuffle=True)
        ),
        "fabric": _tools.fabric(False, 1).setup_dataloaders(
            DataLoader(dataset, batch_size=RESUME_BATCH, shuffle=True)
        ),
    }
    result = {}
    for position in (10, 100_000):
        seconds = {tool: [] for tool in TOOLS}
        for order in abba_order(TOOLS, repeats):
            for tool in order:
                seconds[tool].append(_resume_time(tool, loaders[tool], position))
        result[str(position)] = seconds
    return result


# -- mid-epoch resume correctness ------------------------------------------------------------------------
EPOCHS, SAMPLES, BATCH = 2, 320, 16


def _correctness_parts() -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 32, generator=generator), torch.randint(0, 4, (SAMPLES,)))
    return model, optimizer, data


def train(tool: str, out: Path, stop_at: int | None, save: Path | None, resume: Path | None) -> None:
    """Two epochs of a shuffled loader with dropout and momentum; stop after ``stop_at`` steps and save,
    or resume from ``resume`` (each tool's documented pattern); write the final weights to ``out``."""
    model, optimizer, data = _correctness_parts()
    state, accelerator = {"step": 0}, None
    if tool == "torch":
        sampler = ResumableRandomSampler(len(data))
        # A generator of its own: a loader's iterator otherwise draws its base seed from the global RNG,
        # which the resumed run restores after that draw.
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
        backward = _hand_written_resume(model, optimizer, sampler, state, resume)
    elif tool == "fabric":
        fabric = _tools.fabric(False, 1)
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
        backward = fabric.backward
        if resume is not None:
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(resume / "checkpoint.ckpt", state)
    else:
        accelerator = (
            _tools.lockstep_accelerator(False) if tool == "lockstep" else _tools.accelerate_accelerator(False)
        )
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, DataLoader(data, batch_size=BATCH, shuffle=True)
        )
        backward = accelerator.backward
        if resume is not None:  # transformers' no_trainer pattern: load_state, then skip_first_batches
            accelerator.load_state(str(resume))
            state["step"] = int((resume / "step.txt").read_text())
    first_epoch, skip = divmod(state["step"], -(-SAMPLES // BATCH))
    for epoch in range(first_epoch, EPOCHS):
        batches = loader
        if tool == "torch" and not (epoch == first_epoch and skip):
            sampler.set_epoch(epoch)
        if epoch == first_epoch and skip:
            if tool in ("lockstep", "accelerate"):
                batches = accelerator.skip_first_batches(loader, skip)
            elif tool == "fabric":
                batches = itertools.islice(loader, skip, None)
        for x, y in batches:
            backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] == stop_at:
                _save_for_resume(tool, save, model, optimizer, state, accelerator)
                return
    torch.save({k: v.detach().clone() for k, v in _unwrap(model).state_dict().items()}, out)


def _hand_written_resume(model, optimizer, sampler, state, resume):
    if resume is not None:
        saved = torch.load(resume / "checkpoint.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        state["step"] = saved["step"]
        epoch, batch = divmod(saved["step"], -(-SAMPLES // BATCH))
        sampler.set_epoch(epoch, start=batch * BATCH)
    return lambda loss: loss.backward()


def _save_for_resume(tool, folder, model, optimizer, state, accelerator) -> None:
    if tool == "torch":
        folder.mkdir(parents=True)
        saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**saved, "rng": torch.get_rng_state(), "step": state["step"]}, folder / "checkpoint.pt")
    elif tool == "fabric":
        fabric = _tools.fabric(False, 1)
        fabric.save(
            folder / "checkpoint.ckpt", {"model": model, "optimizer": optimizer, "step": state["step"]}
        )
    else:
        accelerator.save_state(str(folder))
        (folder / "step.txt").write_text(str(state["step"]))


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["io", "resume-time", "train"])
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tool", choices=TOOLS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    if args.part == "train":
        train(args.tool, args.out, args.stop_at, args.save, args.resume)
        return
    if args.part == "io":
        with tempfile.TemporaryDirectory() as tmp:
            result = measure_io(args.params_millions, args.repeats, Path(tmp))
    else:
        result = measure_resume_time(args.repeats)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
