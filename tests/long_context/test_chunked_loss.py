"""Issue 46, item 3: the chunked causal-LM loss equals the model's own loss and never builds the logits.

Tiny Llama (vocab 32,000, hidden 64, 2 layers), batch 2 x sequence 512, 30% of the labels -100, fp32: the loss
within 1e-6 relative, the gradients of ``lm_head.weight`` and of the final hidden states within 1e-6 of the full
cross-entropy; no operator returns a tensor of ``tokens x vocab`` elements or more (the full path does).
"""

from __future__ import annotations

import pytest
import torch

from lockstep import chunked_causal_lm_loss, skip_lm_head
from tests.long_context._models import VOCAB, LargestAllocation, make_llama, token_batch

pytest.importorskip("transformers")

CHUNK = 128


def _full(model, ids, labels, **loss_kwargs):
    """The model's own loss (full logits), with the gradient of its final hidden states."""
    model.zero_grad()
    with skip_lm_head(model.lm_head, keep_logits=True) as seen:
        loss = model(input_ids=ids, labels=labels, **loss_kwargs).loss
    seen.hidden_states.retain_grad()
    loss.backward()
    return loss.detach(), seen.hidden_states.grad, model.lm_head.weight.grad.clone()


def _chunked(model, ids, labels, **loss_kwargs):
    model.zero_grad()
    with skip_lm_head(model.lm_head) as seen:
        outputs = model(input_ids=ids)
    assert outputs.logits.shape == (ids.shape[0], 1, VOCAB)  # the last position's only
    hidden = seen.hidden_states
    hidden.retain_grad()
    loss = chunked_causal_lm_loss(hidden, model.lm_head, labels, chunk_size=CHUNK, **loss_kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, model.lm_head.weight.grad.clone()


def _assert_close(full, chunked, tolerance: float = 1e-6) -> tuple[float, float, float]:
    (loss, hidden_grad, weight_grad), (c_loss, c_hidden_grad, c_weight_grad) = full, chunked
    relative = ((c_loss - loss).abs() / loss.abs()).item()
    hidden_diff = (c_hidden_grad - hidden_grad).abs().max().item()
    weight_diff = (c_weight_grad - weight_grad).abs().max().item()
    assert relative <= tolerance, f"loss {c_loss.item()} vs {loss.item()}: relative {relative:.3g}"
    assert hidden_diff <= tolerance, f"hidden-state gradients differ by {hidden_diff:.3g}"
    assert weight_diff <= tolerance, f"lm_head.weight gradients differ by {weight_diff:.3g}"
    # the gradients are small (1e-4, 1e-2): also within 1e-5 of their largest entry (measured: 2e-7, 4e-7)
    assert hidden_diff <= 1e-5 * hidden_grad.abs().max().item()
    assert weight_diff <= 1e-5 * weight_grad.abs().max().item()
    return relative, hidden_diff, weight_diff


@pytest.fixture(scope="module")
def llama():
    return make_llama()


def test_equals_the_models_own_loss_and_gradients(llama):
    ids, labels = token_batch()
    full, chunked = _full(llama, ids, labels), _chunked(llama, ids, labels)
    _assert_close(full, chunked)
    # the hidden states of ignored positions (and of each row's last position) get no gradient
    assert chunked[1].abs().sum() > 0
    assert torch.equal(chunked[1][:, -1], torch.zeros_like(chunked[1][:, -1]))


def test_num_items_in_batch_divides_the_sum(llama):
    ids, labels = token_batch(seed=1)
    items = torch.tensor(3000)  # a whole accumulation cycle's count, larger than this batch's
    full = _full(llama, ids, labels, num_items_in_batch=items)
    chunked = _chunked(llama, ids, labels, num_items_in_batch=items)
    _assert_close(full, chunked)
    kept = int(labels[:, 1:].ne(-100).sum())
    mean = _chunked(llama, ids, labels)[0]
    assert torch.allclose(chunked[0] * 3000, mean * kept, rtol=1e-6)


def test_tied_embeddings_get_both_gradients():
    model = make_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, labels = token_batch(seed=2)
    full, chunked = _full(model, ids, labels), _chunked(model, ids, labels)
    _assert_close(full, chunked)


def test_bf16_matches_the_models_own_bf16_loss():
    model = make_llama().to(torch.bfloat16)
    ids, labels = token_batch(seed=3, sequence=128)
    full, chunked = _full(model, ids, labels), _chunked(model, ids, labels)
    assert chunked[0].dtype == torch.float32
    assert chunked[2].dtype == torch.bfloat16
    # the logits are the same bf16 products upcast, so the losses agree to fp32 summation order
    assert abs(chunked[0].item() - full[0].item()) / full[0].item() < 1e-6
    # gradients: the full path rounds the weight gradient of all tokens to bf16 once, the chunks sum in fp32
    scale = full[2].float().abs().max().item()
    assert (chunked[2].float() - full[2].float()).abs().max().item() <= 1e-2 * scale
    assert (chunked[1].float() - full[1].float()).abs().max().item() <= 1e-2 * full[
        1
    ].float().abs().max().item()


def test_no_tensor_of_tokens_by_vocab_is_allocated(llama):
    ids, labels = token_batch()
    tokens_by_vocab = ids.numel() * VOCAB
    with LargestAllocation() as chunked:
        _chunked(llama, ids, labels)
    assert chunked.largest <= CHUNK * VOCAB < tokens_by_vocab, (chunked.largest, chunked.largest_op)
    with LargestAllocation() as full:  # the check sees the full path's logits
        _full(llama, ids, labels)
    assert full.largest >= tokens_by_vocab, (full.largest, full.largest_op)


def _reference(hidden, weight, bias, labels, softcap):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_bias_and_softcapping(softcap):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300)
    hidden = torch.randn(3, 20, 16, requires_grad=True)
    labels = torch.randint(0, 300, (3, 20))
    labels[0, :7] = -100
    expected = _reference(hidden, head.weight, head.bias, labels, softcap)
    grads = torch.autograd.grad(expected, (hidden, head.weight, head.bias))
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=7, softcap=softcap)
    chunked_grads = torch.autograd.grad(loss, (hidden, head.weight, head.bias))
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    for ours, theirs in zip(chunked_grads, grads):
        assert (ours - theirs).abs().max().item() <= 1e-6


def test_weight_tensor_and_shifted_labels():
    torch.manual_seed(1)
    weight, bias = torch.randn(50, 8), torch.randn(50)
    hidden, labels = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    a = chunked_causal_lm_loss(hidden, weight, labels, bias=bias, chunk_size=3)
    b = chunked_causal_lm_loss(hidden.reshape(10, 8), weight, shifted.reshape(10), bias=bias, shift=False)
    assert torch.allclose(a, b, rtol=1e-6)
    everything_ignored = torch.full_like(labels, -100)
    assert chunked_causal_lm_loss(hidden, weight, everything_ignored, num_items_in_batch=4).item() == 0.0


def test_bad_input_is_named():
    head = torch.nn.Linear(8, 50)
    hidden, labels = torch.randn(2, 5, 8), torch.randint(0, 50, (2, 5))
    with pytest.raises(ValueError, match=r"chunk_size=0\) is invalid"):
        chunked_causal_lm_loss(hidden, head, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"labels of shape \(2, 4\) do not match"):
        chunked_causal_lm_loss(hidden, head, labels[:, :4])
    with pytest.raises(ValueError, match=r"weight has shape \(50, 4\)"):
        chunked_causal_lm_loss(hidden, torch.randn(50, 4), labels)
    with pytest.raises(TypeError, match=r"lm_head=ReLU\) needs the output projection"):
        chunked_causal_lm_loss(hidden, torch.nn.ReLU(), labels)
    with pytest.raises(RuntimeError, match="lm_head was not called"), skip_lm_head(head) as seen:
        seen.hidden_states  # noqa: B018


def test_backward_recomputes_under_the_forwards_autocast():
    """Backward runs outside autocast; the recomputed logits and their products are still the forward's bf16
    ones, as the full path's backward: the hidden states' gradient within bf16 rounding of it (measured 5e-4 of
    its largest entry; 4.7e-3 when backward recomputes in fp32)."""
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    labels = torch.randint(0, 300, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _reference(hidden, head.weight, None, labels, None)
        chunked = chunked_causal_lm_loss(hidden, head, labels, chunk_size=16)
    assert abs(chunked.item() - full.item()) <= 1e-6 * full.item()
    (expected,) = torch.autograd.grad(full, hidden)
    (ours,) = torch.autograd.grad(chunked, hidden)
    assert (ours - expected).abs().max().item() <= 1e-3 * expected.abs().max().item()
