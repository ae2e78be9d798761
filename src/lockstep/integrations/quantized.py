"""Models with 4-bit layers from ``bitsandbytes`` (QLoRA's base): kept in the layout they were loaded in.

bitsandbytes is never imported here: a model holds its 4-bit layers only when the user loaded it with
``BitsAndBytesConfig(load_in_4bit=True)``, so bitsandbytes is already in ``sys.modules``.

bitsandbytes 0.50 rewrites a ``Linear4bit`` weight in place, into a layout for its CPU inference kernel, the first
time the layer runs in eval mode on an input without gradient on a CPU with AVX512-BF16 (``forward`` sets
``weight.data`` and marks the shared quantisation state ``packing_format_for_cpu``). Measured with a tiny 4-bit
Llama and LoRA on this kind of machine (one evaluation after the first and second optimizer steps):

- under FSDP2 the rewrite is made on the all-gathered weight and lost at the next all-gather while the state
  still says it happened: the following training steps ran on wrongly decoded weights (loss 4.1839 at the third
  step where the run without evaluation had 4.1504), with no error;
- the rewritten kernel's results depend on the rows of the batch: the evaluation loss on 2 processes (4 rows
  each) was 4.178036 where one process (8 rows) had 4.176218;
- one process trained on after an evaluation to other weights than without it (4.150968 against 4.150402):
  the rewritten layers run bitsandbytes' ``gemv_4bit``, which has no autograd kernel, and torch warns that
  backward through it "may lead to silently incorrect behavior".

With the rewrite switched off (``support_avx512bf16_for_cpu = False`` on each layer, what the layer checks) one
process, DDP and FSDP2 gave the same losses within 1e-6, evaluations included. So ``prepare`` switches it off.
"""

from __future__ import annotations

import sys

from torch import nn


def keep_4bit_layout(model: nn.Module) -> int:
    """Stop bitsandbytes' ``Linear4bit`` layers in ``model`` from rewriting their weights for the CPU inference
    kernel (see the module's docstring); returns how many layers there are."""
    layer_class = _linear_4bit_class()
    if layer_class is None:
        return 0
    layers = [module for module in model.modules() if isinstance(module, layer_class)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def _linear_4bit_class() -> type | None:
    bitsandbytes = sys.modules.get("bitsandbytes")
    layer_class = getattr(getattr(bitsandbytes, "nn", None), "Linear4bit", None)
    return layer_class if isinstance(layer_class, type) else None
