"""The local-window branch any constant-state mixer can put in front of its memory (``<mixer>_window`` = w).

Token t reads the last w tokens (t-w, t] with exact softmax attention (the teacher's q/k/v and RoPE), and the
mixer's memory for everything older: a token's write into the memory is delayed until it leaves the window, so the
memory at t holds exactly the tokens <= t - w. The two reads are combined with one shared normaliser when the memory
has one (it returns the log of its total read weight, e.g. RSA's log sum_j mass_j exp(q.SK_j / sqrt(d)), the
cluster approximation of the softmax mass its tokens would have had):

    o_t = (Z_window o_window + Z_memory o_memory) / (Z_window + Z_memory)

and through a learned per-head gate g (o = o_window + sigmoid(g) (o_memory - o_window)) when it has not. A memory
that has received nothing yet has weight exactly 0, so any sequence no longer than the window gives the teacher's
attention exactly.

The decode state stays constant in the context length: the last w keys, values and validity flags (plus whatever
per-token inputs the memory's write needs, e.g. RSA's decay), the memory's own state and the count of written
tokens (``WindowState``).

Shapes: queries (B, G, g, T, d) (G KV heads of g query heads each), keys (B, G, T, d), values (B, G, T, dv),
valid (B, T) bool. The window is by position, as sliding-window attention is: with left padding (what
``generate`` uses) every row reads exactly what it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from .cache import map_tensors
from .registry import MixerOption, non_negative_int


def window_option(mixer: str) -> MixerOption:
    """The ``<mixer>_window`` option, declared by every mixer that supports the branch."""
    return MixerOption(f"{mixer}_window", 0, "local window w: exact softmax attention over the last w tokens, the "
                       "memory for the older ones (0: off, the memory reads everything)", non_negative_int,
                       at_most="max_position_embeddings")


@dataclass
class WindowState:
    """The decode state of a windowed mixer: the last w tokens and the memory of the ones before them."""

    keys: torch.Tensor  # (B, G, w, d) rotated keys of the last w positions (zeros where invalid)
    values: torch.Tensor  # (B, G, w, dv)
    valid: torch.Tensor  # (B, w) bool: a real token sits there
    extras: tuple | None  # per-token write inputs of the memory, each (B, G, w, ...) (RSA: log decay; SSMs: u, B,
    # decay; VORT: key features, order); None before the first call
    memory: object  # the mixer's own state (anything ``map_tensors`` handles), None before the first write
    written: torch.Tensor  # (B,) tokens written into the memory so far

    def map(self, fn) -> "WindowState":
        return WindowState(**{f.name: map_tensors(getattr(self, f.name), fn) for f in fields(self)})


def empty_window(keys: torch.Tensor, values: torch.Tensor, window: int) -> WindowState:
    """The state before the first token: w invalid positions, nothing written (the extras are shaped by the first
    call's)."""
    batch, groups = keys.shape[:2]
    return WindowState(keys=keys.new_zeros(batch, groups, window, keys.shape[-1]),
                       values=values.new_zeros(batch, groups, window, values.shape[-1]),
                       valid=torch.zeros(batch, window, dtype=torch.bool, device=keys.device), extras=None,
                       memory=None, written=torch.zeros(batch, dtype=torch.long, device=keys.device))


# Scores one call of ``window_attention`` holds at most, (B, G, g, block, 2w) per block of w queries: longer inputs go
# a segment of queries at a time. All at once, the scores grew with T (75 MB at 16K for SmolLM2) past glibc's mmap
# threshold, and every such tensor was mapped and faulted in afresh: the window's time grew 3x from 8K to 16K.
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
    allowed = allowed[:, :, :, None]  # (B, 1, N, 1, block, span)
    # the g query heads of a KV head as the rows of one product per block: no copy of the scores to reorder them
    shape = query_b.shape
    scores = ((query_b * scale).flatten(3, 4) @ spans_k).view(*shape[:5], -1)  # (B, G, N, g, block, span)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    # log Z from the softmax itself (its largest weight is exp(0) / Z): on a CPU, torch.logsumexp and torch.exp of the
    # masked scores take a slow path for inputs below ~-88 (10-20x a softmax's time: 2/3 of this function's)
    log_z = scores.amax(-1) - torch.log(weights.amax(-1))  # (B, G, N, g, block)
    out = (weights.flatten(3, 4) @ spans_v).view(*shape[:5], -1)  # (B, G, N, g, block, dv)

    def in_order(t):  # (B, G, N, g, block, ...) -> (B, G, g, T, ...)
        return t.transpose(2, 3).flatten(3, 4)[:, :, :, :length]

    out, log_normaliser = in_order(out), in_order(log_z)
    if not with_entropy:
        return out, log_normaliser
    # H = log Z - sum_c p_c s_c over the allowed keys, over its maximum log(count)
    seen = allowed.sum(-1).to(scores.dtype)  # (B, 1, N, 1, block)
    entropy = log_z - (weights * scores.masked_fill(~allowed, 0)).sum(-1)
    entropy = torch.where(seen > 1, entropy / torch.log(seen.clamp(min=2)), 0.0)
    return out, log_normaliser, in_order(entropy)


# memory(query, keys, values, valid, extras, memory_state) -> (output (B, G, g, T, dv), log weight (B, G, g, T) or
# None, new memory state): the mixer's constant-state read after writing, at each step, the token leaving the window
# (or, for the additive combinations, the new token itself)
Memory = Callable[..., tuple]
COMBINES = ("shared", "convex", "sum", "gated_sum")


def windowed(query, keys, values, valid, extras, state: WindowState | None, window: int, scale: float,
             memory: Memory, gate: torch.Tensor | None = None, combine: str | None = None):
    """The mixer's output with a local window of ``window`` tokens in front of ``memory`` -> (B, G, g, T, dv) and
    the new ``WindowState``.

    ``extras``: per-token write inputs (B, G, T, ...) the memory receives with its token, or a function of the
    window's normalised entropy (B, G, g, T) returning them (VORT's order reads it). ``combine``:
        "shared"     one normaliser over window and memory (the memory returns its log weight); writes delayed
        "convex"     window + sigmoid(gate) (memory - window); writes delayed
        "gated_sum"  window + sigmoid(gate) memory; writes delayed
        "sum"        window + memory, the memory reading every token (its writes not delayed: VORT's eq. 17)
    None: "shared" when the memory returns a log weight, else "convex". ``gate`` (G, g): per-head logits.
    """
    length = query.shape[3]
    if valid is None:
        valid = torch.ones(query.shape[0], length, dtype=torch.bool, device=query.device)
    if state is None:
        state = empty_window(keys, values, window)
    keys = torch.cat([state.keys.to(keys.dtype), keys], dim=2)  # (B, G, w + T, d): position w + i is new token i
    values = torch.cat([state.values.to(values.dtype), values], dim=2)
    valid = torch.cat([state.valid, valid], dim=1)
    local, local_log, *entropy = window_attention(query, keys, values, valid, window, scale,
                                                  with_entropy=callable(extras))
    new_extras = extras(entropy[0]) if callable(extras) else extras
    old_extras = state.extras if state.extras is not None else \
        tuple(e.new_zeros(e.shape[0], e.shape[1], window, *e.shape[3:]) for e in new_extras)
    extras = tuple(torch.cat([old.to(new.dtype), new], dim=2) for old, new in zip(old_extras, new_extras,
                                                                                     strict=True))
    delayed = combine != "sum"
    if delayed:  # query i sees the memory after the write of position i: the token that has just left its window
        span = slice(0, length)
    else:  # the memory reads every token, the window on top
        span = slice(window, window + length)
    writing = valid[:, span]
    remote, remote_log, memory_state = memory(query, keys[:, :, span], values[:, :, span], writing,
                                              tuple(e[:, :, span] for e in extras), state.memory)
    if combine == "sum":
        out = local + remote.to(local.dtype)
    else:
        if combine is None:
            combine = "shared" if remote_log is not None else "convex"
        written = state.written[:, None] + writing.long().cumsum(1)  # (B, T) tokens in the memory at each query
        # a query whose leaving token is padding reads the window alone (with left padding its memory is empty)
        seen = ((written > 0) & writing)[:, None, None]  # (B, 1, 1, T)
        if combine == "shared":
            if remote_log is None:
                raise ValueError("windowed: combine='shared' needs a memory that returns its log weight")
            share = torch.sigmoid(remote_log - local_log)  # Z_memory / (Z_window + Z_memory)
        elif combine in ("convex", "gated_sum"):
            share = torch.sigmoid(gate.to(local.dtype))[None, :, :, None].expand_as(local_log)
        else:
            raise ValueError(f"windowed: combine must be one of {COMBINES}, got {combine!r}")
        share = torch.where(seen, share.to(local.dtype), torch.zeros((), dtype=local.dtype, device=local.device))
        remote = remote.to(local.dtype)
        out = local + share[..., None] * (remote if combine == "gated_sum" else remote - local)
    # the last w positions as dense tensors (w rows, not views into w + T): a compiled decode step writes them so
    # and its next call sees the strides it was compiled for, with no copy in between
    last = lambda t, dim: t.narrow(dim, length, window).clone(memory_format=torch.contiguous_format)  # noqa: E731
    state = WindowState(keys=last(keys, 2), values=last(values, 2), valid=last(valid, 1),
                        extras=tuple(last(e, 2) for e in extras), memory=memory_state,
                        written=state.written + writing.long().sum(1))
    return out, state
