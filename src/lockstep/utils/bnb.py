"""``accelerate.utils.bnb``: importable, not supported (lockstep does not integrate bitsandbytes).

Calling these functions raises ``NotImplementedError``; quantize with bitsandbytes (or transformers'
``BitsAndBytesConfig``) before preparing the model.
"""

from lockstep.utils.unsupported import has_4bit_bnb_layers, load_and_quantize_model

__all__ = ["has_4bit_bnb_layers", "load_and_quantize_model"]
