"""The tiny Llama of issue 46's chunked-loss checks: a 32,000-token vocabulary on 64 hidden units."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.llama import tiny_llama_config

VOCAB, HIDDEN, SEQUENCE, BATCH = 32_000, 64, 512, 2


def make_llama(seed: int = 0, *, sequence: int = SEQUENCE, tie_word_embeddings: bool = False) -> Any:
    """A fresh 2-layer ``LlamaForCausalLM`` (vocab 32,000, hidden 64, SDPA, fp32) with the weights of ``seed``."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        max_position_embeddings=sequence,
        attention_dropout=0.0,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def token_batch(
    seed: int = 0, *, rows: int = BATCH, sequence: int = SEQUENCE, ignored: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``: random tokens, the labels the inputs with a fraction ``ignored`` set to -100."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, sequence), generator=generator)
    labels = ids.clone()
    labels[torch.rand(rows, sequence, generator=generator) < ignored] = -100
    return ids, labels


class LargestAllocation(TorchDispatchMode):
    """Records the element count of every tensor an operator returns (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.largest_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for output in outputs:
            if isinstance(output, torch.Tensor) and output.numel() > self.largest:
                self.largest, self.largest_op = output.numel(), str(func)
        return result


def full_weights(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, whole (DTensors gathered), flat."""
    from torch.distributed.tensor import DTensor

    parts = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts])
