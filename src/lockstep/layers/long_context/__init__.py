"""Long sequences and big vocabularies (issue 46): the causal-LM loss that never builds the full logits,
and packed documents kept apart.

* :func:`chunked_causal_lm_loss`: ``lm_head`` and cross-entropy chunk by chunk with recompute, the positions
  without a target dropped first; equal to the model's own loss (``num_items_in_batch`` honoured).
* :func:`skip_lm_head`: during a model's forward, keeps the hidden states ``lm_head`` receives and lets it
  project only the last position, so that a prepared (DDP, tensor-parallel) model's forward gives what the
  chunked loss needs.
* :func:`keep_documents_apart` (applied by ``Accelerator.prepare`` to transformers models): a packed batch
  (``position_ids`` restarting per document, no attention mask) gets a block-causal mask for SDPA and eager
  attention, so that documents never attend to each other; refused by name under context parallelism.
  :func:`document_ids` and :func:`block_causal_mask` are its parts.
* :class:`ChunkedCausalLMLoss` (built by :func:`trainer_loss`): the Trainer's loss with
  ``TrainingArguments(loss_type="chunked_nll")``.

The package stays torch-free (``TrainingArguments`` reads :mod:`~lockstep.layers.long_context.options`);
the rest loads on first use.
"""

from lockstep._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "DEFAULT_CHUNK_SIZE": "lockstep.layers.long_context._chunked_loss",
        "ChunkedCausalLMLoss": "lockstep.layers.long_context._trainer_loss",
        "LMHeadInput": "lockstep.layers.long_context._capture",
        "block_causal_mask": "lockstep.layers.long_context._packing",
        "chunked_causal_lm_loss": "lockstep.layers.long_context._chunked_loss",
        "document_ids": "lockstep.layers.long_context._packing",
        "keep_documents_apart": "lockstep.layers.long_context._packing",
        "skip_lm_head": "lockstep.layers.long_context._capture",
        "trainer_loss": "lockstep.layers.long_context._trainer_loss",
    },
)
