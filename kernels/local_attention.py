"""Softmax attention over a local window: each query reads the w positions up to and including its own.

Shapes: queries (B, G, g, T, d) (G KV heads of g query heads each); keys, values and valid hold w earlier positions
then the T new ones, (B, G, w + T, d), (B, G, w + T, dv), (B, w + T) bool; query i (position w + i) reads positions
i+1 .. w+i that are valid. Every path returns the output (B, G, g, T, dv), the log of its softmax normaliser
(B, G, g, T) and, on request, each query's softmax entropy over log(number of keys it sees) (VORT's order reads it).

Two paths, one result (``local_attention`` picks through kernels/dispatch.py):

    window_attention   PyTorch: queries in blocks of w, each against a span of 2w keys, O(T w); the CPU path, the
                       path of short calls, and the reference
    flex_attention     torch.nn.attention.flex_attention on CUDA: the band as a block mask built from the shapes, the
                       padding as a score_mod, the normaliser from ``return_aux``; one fused kernel forward and one
                       backward. The entropy comes from the same call: with the keys appended to the values, the
                       output's key part is sum_c p_c k_c, and H = log Z - scale q . sum_c p_c k_c
                       (``flex_read_entropy``: one Triton launch each way, kernels/local_attention_triton.py).

A query that sees no valid key (a padding position) reads its own position on the flex path (a finite normaliser
with no clamp after the kernel), and an arbitrary output on the PyTorch path: no caller reads either (its share of
the memory is 0).
``ring_attention`` is the decode step's form, one query against the window's ring.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from .conventions import shape_constant
from .dispatch import library_kernel, use_triton

# Scores one call of ``window_attention`` holds at most, (B, G, g, block, 2w) per block of w queries: longer inputs go
# a segment of queries at a time. All at once, the scores grew with T past glibc's mmap threshold, and every such
# tensor was mapped and faulted in afresh: the window's time grew faster than T.
SEGMENT_SCORES = 1 << 20


def window_attention(query, keys, values, valid, window: int, scale: float, with_entropy: bool = False):
    """Softmax attention of T queries over the window before each: ``keys`` / ``values`` / ``valid`` hold w earlier
    positions then the T new ones ((B, G, w + T, ...)), query i (position w + i) reads positions i+1 .. w+i.

    Returns the output (B, G, g, T, dv) and the log of its softmax normaliser (B, G, g, T), both in the queries'
    dtype; ``with_entropy`` adds the entropy of each query's softmax row divided by log(number of keys it sees)
    (in [0, 1], 0 when it sees one key). Queries of long inputs go in blocks of w, each reading a span of 2w keys:
    O(T w), not O(T^2); and in segments of ``SEGMENT_SCORES`` scores.
    """
    batch, groups, per_group, length, _ = query.shape
    segment = window * max(1, SEGMENT_SCORES // (batch * groups * per_group * 2 * window * window))
    if length > segment:  # a segment of queries at a time, each with the w positions before it: the same values
        spans = [(slice(start, start + segment), slice(start, start + segment + window))
                 for start in range(0, length, segment)]
        parts = [window_attention(query[:, :, :, rows], keys[:, :, span], values[:, :, span], valid[:, span], window,
                                  scale, with_entropy) for rows, span in spans]
        return tuple(torch.cat(part, dim=3) for part in zip(*parts))
    if length <= window:  # one block (decode, short prefill): every query against all w + T positions
        query_b = query[:, :, None]  # (B, G, 1, g, T, d)
        spans_k, spans_v, spans_valid = keys[:, :, None].transpose(-1, -2), values[:, :, None], valid[:, None]
        offsets = torch.arange(window + length, device=query.device)[None, :] - window  # key index - query's index 0
        rows = torch.arange(length, device=query.device)[:, None]
    else:
        blocks = -(-length // window)
        pad = blocks * window - length
        if pad:
            query = torch.nn.functional.pad(query, (0, 0, 0, pad))
            keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
            values = torch.nn.functional.pad(values, (0, 0, 0, pad))
            valid = torch.nn.functional.pad(valid, (0, pad))
        query_b = query.unflatten(3, (blocks, window)).transpose(2, 3)  # (B, G, N, g, w, d)
        spans_k = keys.unfold(2, 2 * window, window)  # (B, G, N, d, 2w): positions bw .. bw+2w-1
        spans_v = values.unfold(2, 2 * window, window).transpose(-1, -2)  # (B, G, N, 2w, dv)
        spans_valid = valid.unfold(1, 2 * window, window)  # (B, N, 2w)
        offsets = torch.arange(2 * window, device=query.device)[None, :] - window
        rows = torch.arange(window, device=query.device)[:, None]
    # key at span index c is position (first query's position - w + c); query r reads it when 0 <= r - (c - w) < w
    gap = rows - offsets  # (block, span)
    allowed = (gap >= 0) & (gap < window) & spans_valid[:, None, :, None, :]
    return _attend(query_b, spans_k, spans_v, allowed[:, :, :, None], scale, length, with_entropy)


def ring_attention(query, keys, values, valid, scale: float, with_entropy: bool = False):
    """One query a row (B, G, g, 1, d) against every valid slot of the window's ring (its own token written in):
    what ``window_attention`` gives the last of w + 1 positions, without ordering the ring."""
    allowed = valid[:, None, None, None, None, :]  # (B, 1, 1, 1, 1, w)
    return _attend(query[:, :, None], keys[:, :, None].transpose(-1, -2), values[:, :, None], allowed, scale, 1,
                   with_entropy)


def _attend(query_b, spans_k, spans_v, allowed, scale: float, length: int, with_entropy: bool):
    """Masked softmax attention of query blocks (B, G, N, g, block, d) over their spans of keys (B, G, N, d, span)
    and values (B, G, N, span, dv), ``allowed`` (B, 1, N, 1, block, span) -> the first ``length`` queries' outputs,
    log normalisers [and normalised entropies] in order (B, G, g, T, ...)."""
    # the g query heads of a KV head as the rows of one product per block: no copy of the scores to reorder them
    shape = query_b.shape
    scores = ((query_b * scale).flatten(3, 4) @ spans_k).view(*shape[:5], -1)  # (B, G, N, g, block, span)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    # log Z from the softmax itself (its largest weight is exp(0) / Z): on a CPU, torch.logsumexp and torch.exp of the
    # masked scores take a slow path for inputs below ~-88 (many times a softmax's time)
    log_z = scores.amax(-1) - torch.log(weights.amax(-1))  # (B, G, N, g, block)
    out = (weights.flatten(3, 4) @ spans_v).view(*shape[:5], -1)  # (B, G, N, g, block, dv)

    def queries_in_order(t):  # (B, G, N, g, block, ...) -> (B, G, g, T, ...)
        return t.transpose(2, 3).flatten(3, 4)[:, :, :, :length]

    out, log_normaliser = queries_in_order(out), queries_in_order(log_z)
    if not with_entropy:
        return out, log_normaliser
    # H = log Z - sum_c p_c s_c over the allowed keys, over its maximum log(count)
    seen = allowed.sum(-1).to(scores.dtype)  # (B, 1, N, 1, block)
    entropy = log_z - (weights * scores.masked_fill(~allowed, 0)).sum(-1)
    entropy = torch.where(seen > 1, entropy / torch.log(seen.clamp(min=2)), 0.0)
    return out, log_normaliser, queries_in_order(entropy)


# The flex path ------------------------------------------------------------------------------------------------------

FLEX_BLOCK = 128  # flex_attention's sparse block, both sides
_compiled_flex = None


def band_block_mask(length: int, span: int, window: int, device, block: int | None = None):
    """The band of ``window`` as a flex BlockMask over ``length`` queries and ``span`` = w + length keys, in blocks
    of ``block`` (``FLEX_BLOCK``) a side, built from the shapes (no mask evaluated over the T x S grid): query block
    i reads the key blocks from the one holding its first query's first key to the one holding its last query's last
    key. No block is marked full, so the score_mod (the padding) and the band's mask_mod apply in every block read."""
    block = block or FLEX_BLOCK

    def build():
        query_blocks, key_blocks = -(-length // block), -(-span // block)
        starts = torch.arange(query_blocks, device=device) * block
        first = (starts + 1) // block
        last = ((starts + block).clamp(max=length) - 1 + window).clamp(max=span - 1) // block
        indices = (first[:, None] + torch.arange(key_blocks, device=device)).clamp(max=key_blocks - 1)

        def band(batch, head, query, key):  # key index c is read by query i when i + 1 <= c <= i + w
            gap = query + window - key
            return (gap >= 0) & (gap < window)

        return BlockMask.from_kv_blocks((last - first + 1).int()[None, None], indices.int()[None, None],
                                        BLOCK_SIZE=block, mask_mod=band, seq_lengths=(length, span))

    return shape_constant(("band", length, span, window, block, str(device)), build)


def flex_window_attention(query, keys, values, valid, window: int, scale: float, with_entropy: bool = False,
                          flex=None, backend: str = "auto"):
    """``window_attention`` through flex_attention (``flex``: the function to call, torch's by default; on CUDA the
    caller passes a compiled one outside torch.compile, since eager flex_attention materialises every score).
    ``backend``: the entropy epilogue's path (``flex_read_entropy``)."""
    flex = flex or flex_attention
    batch, groups, per_group, length, dim = query.shape
    span = keys.shape[2]
    value_dim = values.shape[-1]
    if with_entropy:  # the key part of the output is sum_c p_c k_c (module docstring)
        values = torch.cat([values, keys.to(values.dtype)], dim=-1)

    own = span - length  # query i sits at key index w + i

    def padding(score, batch, head, query, key):  # a padding query reads itself: its row's normaliser stays finite
        return torch.where(valid[batch, key] | (key == query + own), score, -float("inf"))

    out, aux = flex(query.flatten(1, 2), keys, values, score_mod=padding,
                    block_mask=band_block_mask(length, span, window, query.device), scale=scale, enable_gqa=True,
                    return_aux=AuxRequest(lse=True))
    out, lse = out.unflatten(1, (groups, per_group)), aux.lse.unflatten(1, (groups, per_group))
    if with_entropy:
        return flex_read_entropy(out, lse, query, valid, window, value_dim, scale, backend)
    return out, lse.to(query.dtype)


def flex_read_entropy(out, lse, query, valid, window: int, value_dim: int, scale: float, backend: str = "auto"):
    """Split flex's output over [values, keys] (B, G, g, T, dv + d) into the read o and m = sum_c p_c k_c, and
    return (o, log Z, H): log Z = lse (B, G, g, T) clamped to the dtype's min (a query that sees no key has -inf),
    H = (log Z - scale q . m) / log(s), s the valid keys among the query's window (H = 0 where s <= 1); log Z and H
    in the queries' dtype. One Triton launch each way where kernels/dispatch.py takes Triton
    (kernels/local_attention_triton.py); else this math, which is the kernel's reference."""
    if use_triton("window entropy", out.device, backend, check=lambda: None if out.dtype in (
            torch.float32, torch.float64) else f"{out.dtype} reads (the kernel takes fp32 or fp64)"):
        from .local_attention_triton import read_entropy_triton

        return read_entropy_triton(out, lse, query, valid, window, value_dim, scale)
    log_normaliser = lse.clamp(min=torch.finfo(lse.dtype).min).to(query.dtype)
    out, mean_key = out[..., :value_dim], out[..., value_dim:]
    # keys each query sees: the valid positions among i+1 .. i+w, from one cumulative sum
    length = query.shape[3]
    counted = torch.nn.functional.pad(valid.cumsum(1), (1, 0))  # (B, w + T + 1): valid positions before each index
    seen = (counted[:, window + 1:] - counted[:, 1:length + 1]).to(query.dtype)[:, None, None]  # (B, 1, 1, T)
    entropy = log_normaliser - scale * (query * mean_key.to(query.dtype)).sum(-1)
    entropy = torch.where(seen > 1, entropy / torch.log(seen.clamp(min=2)), 0.0)
    return out, log_normaliser, entropy


def _flex_unsupported(query, length: int, window: int) -> str | None:
    """Why flex_attention does not take this call (None: it does)."""
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{query.dtype} inputs (flex_attention's kernel takes fp32 at most)"
    if length <= window:
        return "a call no longer than the window (one block of the PyTorch form)"
    return None


def compiled_flex(flex):
    """flex_attention compiled once a process (its fused kernel; eager flex_attention is the dense reference)."""
    global _compiled_flex
    if torch.compiler.is_compiling():  # inside a compiled step: dynamo traces flex_attention itself
        return flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex)
    return _compiled_flex


def local_attention(query, keys, values, valid, window: int, scale: float, with_entropy: bool = False,
                    backend: str = "auto"):
    """The entry: ``window_attention``'s result, through flex_attention where kernels/dispatch.py takes it (CUDA,
    calls longer than the window), else through the PyTorch form. ``backend``: as ``config.kernel_backend``."""
    length = query.shape[3]
    flex = library_kernel("local window attention", "torch.nn.attention.flex_attention", "flex_attention",
                          query.device, backend, check=lambda: _flex_unsupported(query, length, window))
    if flex is None:
        return window_attention(query, keys, values, valid, window, scale, with_entropy)
    if query.device.type == "cuda":
        flex = compiled_flex(flex)
    return flex_window_attention(query, keys, values, valid, window, scale, with_entropy, flex=flex, backend=backend)
