"""Loads a small BERT with ``from_pretrained`` after ``Accelerator()``, trains it a few steps under whatever
the launcher configured (an FSDP2 file with ``fsdp_cpu_ram_efficient_loading: true``, or DDP) and writes the
full final weights and what each process saw at loading.

usage: pretrained_fsdp_train.py MODEL_DIR OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from lockstep import Accelerator
from lockstep.utils import set_seed

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
accelerator = Accelerator()
set_seed(0)
model = AutoModelForSequenceClassification.from_pretrained(model_dir)
saved = load_file(model_dir / "model.safetensors")
loaded = {
    "rank": accelerator.process_index,
    "transformers": transformers.__version__,
    "rank0_loading_announced": os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", ""),
    "parameters": len(saved),
    # parameters holding the file's values after from_pretrained (meta ones count as not read)
    "read_from_file": sum(
        not tensor.is_meta and torch.equal(tensor, saved[name])
        for name, tensor in model.state_dict().items()
        if name in saved
    ),
}
model.train()
for module in model.modules():  # dropout off: DDP and FSDP runs then differ only in reduction order
    if isinstance(module, torch.nn.Dropout):
        module.p = 0.0
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(1)
for _step in range(4):
    ids = torch.randint(0, 64, (4 * accelerator.num_processes, 12), generator=generator)
    labels = torch.randint(0, 2, (4 * accelerator.num_processes,), generator=generator)
    mine = slice(4 * accelerator.process_index, 4 * (accelerator.process_index + 1))
    loss = model(input_ids=ids[mine], labels=labels[mine]).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
state = accelerator.get_state_dict(model)
(out / f"loaded_{accelerator.process_index}.json").write_text(json.dumps(loaded))
if accelerator.is_main_process:
    torch.save({name: tensor.detach().cpu().clone() for name, tensor in state.items()}, out / "final.pt")
    (out / "state.json").write_text(json.dumps({"distributed_type": accelerator.distributed_type.value}))
accelerator.end_training()
