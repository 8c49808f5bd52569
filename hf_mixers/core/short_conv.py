"""The short causal depthwise convolution in front of a recurrent mixer (RSA's option, every selective SSM's input).

    out_t[c] = bias[c] + sum_k weight[c, k] x_{t-K+1+k}[c]        (weight (C, K): tap K - 1 is the current token)

Padded inputs are zeroed first, so a left-padded row sees exactly the zero history a sequence alone starts with; the
last K - 1 inputs come back as the decode history, so a prefill in chunks and token-by-token decoding equal one
forward.
"""

from __future__ import annotations

import torch


def causal_conv(hidden_states, weight, bias=None, token_mask=None, history=None):
    """(B, T, C) -> (B, T, C) and the last K - 1 inputs (B, K - 1, C), the history the next call continues from."""
    batch, length, channels = hidden_states.shape
    width = weight.shape[1]
    if weight.shape[0] != channels:
        raise ValueError(f"causal_conv: weight is for {weight.shape[0]} channels, the input has {channels}")
    if token_mask is not None:
        hidden_states = hidden_states * token_mask[:, -length:, None].to(hidden_states.dtype)
    if history is None:
        history = hidden_states.new_zeros(batch, width - 1, channels)
    padded = torch.cat([history.to(hidden_states.dtype), hidden_states], dim=1)  # (B, K - 1 + T, C)
    # K shifted products in the (B, T, C) layout: F.conv1d wants (B, C, T), and its layout changes there and back
    # made it slower on a CPU and, compiled, an opaque call where these fuse into one kernel
    weight = weight.to(hidden_states.dtype)
    out = padded[:, width - 1:] * weight[:, -1]
    for tap in range(width - 1):
        out = out + padded[:, tap:tap + length] * weight[:, tap]
    if bias is not None:
        out = out + bias.to(hidden_states.dtype)
    return out, padded[:, padded.shape[1] - (width - 1):].clone()  # a copy: a view keeps all T alive
