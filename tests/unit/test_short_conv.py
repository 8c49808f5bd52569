"""core/short_conv.py's causal depthwise convolution against its definition, torch's grouped conv1d, in fp64."""

import pytest
import torch
import torch.nn.functional as F

from hf_mixers.core.short_conv import causal_conv

F64 = torch.float64


def conv1d_reference(x, weight, bias):
    """(B, T, C), zero history: the definition as one grouped convolution over the left-padded sequence."""
    padded = F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0))
    return F.conv1d(padded, weight[:, None, :], bias, groups=x.shape[2]).transpose(1, 2)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_the_grouped_convolution_and_its_gradients(width, with_bias):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(2, 9, 5, dtype=F64, generator=g, requires_grad=True)
    weight = torch.randn(5, width, dtype=F64, generator=g, requires_grad=True)
    bias = torch.randn(5, dtype=F64, generator=g, requires_grad=True) if with_bias else None
    out, history = causal_conv(x, weight, bias)
    expected = conv1d_reference(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(history, x[:, -(width - 1):].detach())
    leaves = [x, weight] + ([bias] if with_bias else [])
    seed = torch.randn(out.shape, dtype=F64, generator=g)
    for got, want in zip(torch.autograd.grad((out * seed).sum(), leaves),
                         torch.autograd.grad((expected * seed).sum(), leaves)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_pieces_and_single_tokens_continue_from_the_history_and_padding_is_zeroed():
    """A left-padded batch in two calls, then token by token, equals one call on the whole; a padded input counts as
    zero (a row sees the history it would alone)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 6, dtype=F64, generator=g)
    weight, bias = torch.randn(6, 4, dtype=F64, generator=g), torch.randn(6, dtype=F64, generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    whole, _ = causal_conv(x, weight, bias, mask)
    torch.testing.assert_close(whole[1, 5:], conv1d_reference(x[1:, 5:], weight, bias)[0], rtol=1e-12, atol=1e-12)
    first, history = causal_conv(x[:, :7], weight, bias, mask[:, :7])
    pieces = [first]
    for t in range(7, 12):  # the mask grows with the sequence, as in generate
        out, history = causal_conv(x[:, t:t + 1], weight, bias, mask[:, :t + 1], history)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-12, atol=1e-12)
    assert history.shape == (2, 3, 6)
