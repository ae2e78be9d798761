"""One run of bench/big_model_inference.py, in a fresh process: load a saved Llama with one tool (lockstep
or Accelerate, the same calls), fully in memory or under a CPU budget with the rest on disk, generate, and
print one JSON line: load seconds, tokens per second, peak resident-memory growth, the tokens.

    python _big_model_worker.py TOOL MODEL_DIR OFFLOAD_DIR BUDGET_BYTES NEW_TOKENS   (BUDGET 0: in memory)
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import torch


def _memory(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(tool: str, model_dir: str, offload: str, budget: int, new_tokens: int) -> None:
    import transformers

    big_modeling = importlib.import_module(f"{tool}.big_modeling")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with big_modeling.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.arange(16).unsqueeze(0) % config.vocab_size
    baseline = _memory("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    started = time.perf_counter()
    model = big_modeling.load_checkpoint_and_dispatch(
        model,
        model_dir,
        device_map={"": "cpu"} if budget == 0 else "auto",
        max_memory=None if budget == 0 else {"cpu": budget},
        no_split_module_classes=model._no_split_modules,
        offload_folder=offload,
        skip_keys="past_key_values",
    )
    loaded = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    generated = time.perf_counter()
    placed = list(getattr(model, "hf_device_map", {"": "cpu"}).values())
    print(
        json.dumps(
            {
                "load_s": loaded - started,
                "tokens_per_s": new_tokens / (generated - loaded),
                "peak_growth": _memory("VmHWM") - baseline,
                "on_disk": placed.count("disk"),
                "tokens": tokens[0, -new_tokens:].tolist(),
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    tool_name, folder, offload_dir, budget_bytes, count = sys.argv[1:]
    measure(tool_name, folder, offload_dir, int(budget_bytes), int(count))
