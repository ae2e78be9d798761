"""Prepare a tiny Qwen3-MoE that transformers loaded sharded (``from_pretrained(..., distributed_config=
DistributedConfig(fsdp_size=N, ep_size=N))``, transformers' own FSDP2 and expert parallelism) with a plain
``Accelerator()``: lockstep refuses it by name (tests/backends/test_tp_plan_auto.py).

Usage: distributed_config_prepare.py MODEL_DIR  (under ``lockstep launch --num-processes N``; transformers needs
the accelerate package on the path for ``distributed_config``)
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

from lockstep import Accelerator

torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
size = int(os.environ["WORLD_SIZE"])
model = AutoModelForCausalLM.from_pretrained(
    sys.argv[1], distributed_config=DistributedConfig(fsdp_size=size, ep_size=size)
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.end_training()
