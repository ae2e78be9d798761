"""Run in a fresh process by tests/big_modeling/test_memory_budget.py: build a :class:`Tower` empty, load its
checkpoint with ``load_checkpoint_and_dispatch`` under a CPU budget, run it, and print (as JSON) the peak
growth of the resident memory during load + forward, its growth once dispatched (before the forward), the
bytes of the blocks placed in memory and on disk, the bytes of offloaded weights read back from the disk
during load + dispatch and during the forward, and the largest difference from the expected output.

The peak is the kernel's high-water mark (VmHWM), reset just before loading through
``/proc/self/clear_refs``; where that file cannot be written, a thread samples the resident memory instead.

Usage: python memory_worker.py CHECKPOINT OFFLOAD_DIR BUDGET_BYTES DEPTH WIDTH INPUTS.pt EXPECTED.pt
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakMeter:
    """The peak resident memory from :meth:`start` on."""

    def __init__(self) -> None:
        self.sampled = 0
        self.sampling = False
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.sampling = True
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled = max(self.sampled, _status("VmRSS"))
            time.sleep(0.0005)

    def peak(self) -> int:
        self._stop.set()
        return max(self.sampled, _status("VmRSS")) if self.sampling else _status("VmHWM")


class OffloadReads:
    """The bytes of offloaded weights read back from their memory-mapped files (every reader of the offload
    folder goes through ``load_offloaded_weight``)."""

    def __init__(self) -> None:
        self.bytes = 0

    def install(self) -> None:
        from lockstep.utils import modeling, offload

        read = offload.load_offloaded_weight

        def counted(weight_file: str, weight_info: dict) -> torch.Tensor:
            tensor = read(weight_file, weight_info)
            self.bytes += tensor.numel() * tensor.element_size()
            return tensor

        offload.load_offloaded_weight = counted
        modeling.load_offloaded_weight = counted  # imported by name there

    def take(self) -> int:
        """The bytes counted since the last call."""
        counted, self.bytes = self.bytes, 0
        return counted


def _block_bytes(model: torch.nn.Module, placed: dict[str, object], where: str) -> int:
    """The bytes of the parameters of the blocks placed ``where`` (as loaded from the checkpoint: fp32)."""
    return sum(
        parameter.numel() * 4
        for name, device in placed.items()
        if device == where
        for parameter in model.get_submodule(name).parameters()
    )


def main(argv: list[str]) -> None:
    checkpoint, offload, budget, depth, width, inputs_path, expected_path = argv
    from lockstep import load_checkpoint_and_dispatch
    from lockstep.big_modeling import init_empty_weights
    from tests.helpers.big_models import Tower

    reads = OffloadReads()
    reads.install()

    inputs = torch.load(inputs_path)
    expected = torch.load(expected_path)
    with init_empty_weights():
        model = Tower(int(depth), int(width))
    baseline = _status("VmRSS")
    meter = PeakMeter()
    meter.start()
    model = load_checkpoint_and_dispatch(
        model,
        checkpoint,
        "auto",
        max_memory={"cpu": int(budget)},
        offload_folder=offload,
        no_split_module_classes=["Block"],
    )
    dispatched = _status("VmRSS")
    read_at_dispatch = reads.take()
    with torch.no_grad():
        output = model(inputs)
    peak = meter.peak()
    read_in_forward = reads.take()
    placed = list(model.hf_device_map.values())
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak_growth": peak - baseline,
                "dispatched_growth": dispatched - baseline,
                "sampled": meter.sampling,
                "on_cpu": placed.count("cpu"),
                "on_disk": placed.count("disk"),
                "cpu_bytes": _block_bytes(model, model.hf_device_map, "cpu"),
                "disk_bytes": _block_bytes(model, model.hf_device_map, "disk"),
                "read_at_dispatch": read_at_dispatch,
                "read_in_forward": read_in_forward,
                "max_abs_diff": (output - expected).abs().max().item(),
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
