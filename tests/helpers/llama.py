"""The tiny transformers Llama the tests build from a config (no download): 32 wide, 64 tokens."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` of 2 layers, 4 heads (2 key/value heads), untied embeddings; ``overrides`` replace fields."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**(fields | overrides))
