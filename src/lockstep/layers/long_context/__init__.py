"""Long sequences and big vocabularies (issue 46): the causal-LM loss that never builds the full logits,
packed documents kept apart, and the engine of Ulysses sequence parallelism.

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
* Ulysses sequence parallelism, the engine used by hand in a loop (``_ulysses.py``):
  :func:`enable_ulysses` registers the ``"lockstep_ulysses"`` attention (SDPA between two all-to-alls over a
  process group) with transformers' ``AttentionInterface`` and switches a model to it; :func:`ulysses_shard`
  gives this rank its contiguous part of a batch (labels shifted before the split, global ``position_ids``);
  :func:`ulysses_loss` is this rank's share of the loss (its tokens' sum over the step's label tokens,
  :func:`count_label_tokens`); :func:`sum_sequence_gradients` sums the weights' partial gradients over the
  group. Equal to one process (tests/long_context/test_ulysses.py). Next: ``ParallelismConfig(sp_size=N)``
  (still refused in ``config/parallelism.py`` and ``accelerator/settings.py``): an ``sp`` mesh dimension
  outside the data-parallel size, the same batch on every sp rank, the swap at ``prepare``, the split and the
  loss share done by the Accelerator and the Trainer; then DDP/FSDP2 composition, DeepSpeed's ALST keys and
  packed rows under SP.

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
        "count_label_tokens": "lockstep.layers.long_context._ulysses",
        "document_ids": "lockstep.layers.long_context._packing",
        "enable_ulysses": "lockstep.layers.long_context._ulysses",
        "keep_documents_apart": "lockstep.layers.long_context._packing",
        "shift_labels": "lockstep.layers.long_context._ulysses",
        "skip_lm_head": "lockstep.layers.long_context._capture",
        "sum_sequence_gradients": "lockstep.layers.long_context._ulysses",
        "trainer_loss": "lockstep.layers.long_context._trainer_loss",
        "ulysses_loss": "lockstep.layers.long_context._ulysses",
        "ulysses_shard": "lockstep.layers.long_context._ulysses",
        "UlyssesShard": "lockstep.layers.long_context._ulysses",
        "ULYSSES_ATTENTION": "lockstep.layers.long_context._ulysses",
    },
)
