"""The chunked output-head loss: the same loss and gradients as the whole-batch one, without
ever holding a whole micro-batch's logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import ModelConfig
from scaletrain.model.llama import Transformer
from scaletrain.model.loss import IGNORE, Tally, chunked_cross_entropy, cross_entropy


def _inputs(seed=0, batch=3, seq=20, dim=32, vocab=512, padded=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, dim, generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    targets[-1, -padded:] = IGNORE  # padding: no loss, no gradient
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 7, 16, 60, 1000])  # one row, uneven, even, exactly all, more than all
def test_chunked_loss_and_gradients_equal_the_whole_batch_ones(chunk):
    hidden, weight, targets = _inputs()
    whole = cross_entropy(hidden @ weight.T, targets)
    whole.backward()
    expected = (whole.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    loss = chunked_cross_entropy(hidden, weight, targets, chunk)
    (2.5 * loss).backward()  # an upstream gradient other than 1 scales both gradients
    torch.testing.assert_close(loss.detach(), expected[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden.grad, 2.5 * expected[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, 2.5 * expected[2], rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation takes the forward-only path
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, targets, chunk), expected[0], rtol=0, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_matches_the_autocast_linear_and_keeps_parameter_dtypes():
    hidden, weight, targets = _inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = cross_entropy(torch.nn.functional.linear(hidden, weight), targets)
        loss = chunked_cross_entropy(hidden, weight, targets, 16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, whole, rtol=0, atol=2e-3)
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    # The head's weight gradient is a bf16 matmul per chunk (as autocast's whole head computes
    # it), summed in float32: as close to the whole head's as bf16 allows.
    chunked_grad = weight.grad.clone()
    weight.grad = None
    whole.backward()
    torch.testing.assert_close(chunked_grad, weight.grad, rtol=2e-2, atol=2e-4)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any operator produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits_is_ever_made():
    hidden, weight, targets = _inputs(batch=4, seq=32, dim=16, vocab=512)  # logits: 128 x 512; weight 512 x 16
    rows, vocab = 4 * 32, 512
    with _LargestTensor() as whole:
        cross_entropy(hidden @ weight.T, targets).backward()
    assert whole.largest >= rows * vocab  # the check can see the logits when they are made
    with _LargestTensor() as chunked:
        chunked_cross_entropy(hidden, weight, targets, 16).backward()
    assert chunked.largest <= 16 * vocab


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_with_a_loss_chunk_trains_as_one_without(tie):
    cfg = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=tie)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    chunked = Transformer(cfg)
    chunked.load_state_dict(plain.state_dict())
    chunked.loss_chunk = 10
    tokens = torch.randint(0, 256, (3, 16))
    targets = torch.roll(tokens, -1, dims=1)
    losses = []
    for model in (plain, chunked):
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert chunked(tokens).shape == (3, 16, 256)  # without targets it still gives logits


@pytest.mark.parametrize("chunk", [0, 5])
def test_z_loss_adds_palms_gradient_and_leaves_the_reported_loss_the_cross_entropy(chunk):
    """The gradient of cross-entropy + z · mean(log²Z) over the tokens that are not padding, whole
    or in chunks; the value returned is the cross-entropy alone."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 8, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (2, 8))
    targets[0, 3] = IGNORE
    flat, valid = (hidden @ weight.T).flatten(0, 1), targets.flatten() != IGNORE
    plain = torch.nn.functional.cross_entropy(flat, targets.flatten())
    penalised = plain + 0.01 * (torch.logsumexp(flat, dim=-1).square() * valid).sum() / valid.sum()
    expected = torch.autograd.grad(penalised, (hidden, weight), retain_graph=True)
    tally = Tally()
    loss = (chunked_cross_entropy(hidden, weight, targets, chunk, z_loss=0.01, tally=tally) if chunk
            else cross_entropy(hidden @ weight.T, targets, z_loss=0.01, tally=tally))
    assert loss.item() == pytest.approx(plain.item(), abs=1e-6)
    # The z-loss's own value, which the loss leaves out, is tallied for the train records.
    assert (tally.count.item(), (tally.total / tally.count).item()) == (
        15, pytest.approx(((torch.logsumexp(flat, dim=-1).square() * valid).sum() / 15).item(), rel=1e-6))
    for got, want in zip(torch.autograd.grad(loss, (hidden, weight)), expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(expected[0], torch.autograd.grad(plain, hidden)[0], atol=1e-4)  # it does add


def test_z_loss_keeps_for_the_backward_pass_what_the_cross_entropy_keeps_and_a_number_per_token():
    logits = torch.randn(4, 64, 512, requires_grad=True)
    targets = torch.randint(0, 512, (4, 64))

    def saved_bytes(z_loss: float) -> int:
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            cross_entropy(logits, targets, z_loss=z_loss)
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in kept}.values())
    plain, penalised = saved_bytes(0.0), saved_bytes(1e-4)
    assert plain >= 4 * 4 * 64 * 512  # the float32 log-softmax
    assert plain <= penalised <= plain + 4 * 64 * (4 + 8 + 1)  # log Z, the targets, the padding mask
