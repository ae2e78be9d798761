"""Train a tiny Llama that transformers loaded already sharded (``from_pretrained(tp_plan="auto")``).

Usage: tp_plan_auto_train.py MODEL_DIR OUT.pt  (under ``lockstep launch --num-processes N``)

With more than one process the model is loaded with ``tp_plan="auto"`` on lockstep's ``tp`` mesh (transformers
needs the accelerate package for that: the test puts it on PYTHONPATH; lockstep never imports it); with one
process it is loaded plainly. AdamW, accumulation 2, clipping 1.0, 3 optimizer steps on the same global batches
either way. Rank 0 saves the losses, the gradient norms, the full parameters and the q_proj placements.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from lockstep import Accelerator, ParallelismConfig

torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
world_size = int(os.environ.get("WORLD_SIZE", "1"))
config = ParallelismConfig(tp_size=world_size) if world_size > 1 else None
accelerator = Accelerator(cpu=True, parallelism_config=config, gradient_accumulation_steps=2)
if world_size > 1:
    model = LlamaForCausalLM.from_pretrained(
        model_dir, tp_plan="auto", device_mesh=accelerator.torch_device_mesh["tp"]
    )
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor), "transformers did not shard it"
else:
    model = LlamaForCausalLM.from_pretrained(model_dir)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(1)
losses, norms = [], []
for _ in range(6):
    ids = torch.randint(0, 64, (4, 16), generator=generator)
    with accelerator.accumulate(model):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(float(loss.detach()))
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
q_proj = model.model.layers[0].self_attn.q_proj.weight
if accelerator.is_main_process:
    torch.save(
        {
            "losses": losses,
            "norms": norms,
            "params": torch.cat([p.detach().float().reshape(-1) for p in params]),
            "q_proj": [repr(p) for p in q_proj.placements] if isinstance(q_proj, DTensor) else None,
        },
        out,
    )
accelerator.end_training()
