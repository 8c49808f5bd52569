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
tokens (``WindowState``). The window's tensors are ring buffers: a token step reads the slot of the token leaving
the window (what the memory writes) and writes the new token into it in place, one row a step where a shifted copy
would move all w (attention over the window does not depend on the slots' order). A call of several tokens (a
prefill) reads the ring in order, runs the block form below and leaves a new ring.

Shapes: queries (B, G, g, T, d) (G KV heads of g query heads each), keys (B, G, T, d), values (B, G, T, dv),
valid (B, T) bool. The window is by position, as sliding-window attention is: with left padding (what
``generate`` uses) every row reads exactly what it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
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

    keys: torch.Tensor  # (B, G, w, d) rotated keys of the last w positions (zeros where invalid), a ring
    values: torch.Tensor  # (B, G, w, dv)
    valid: torch.Tensor  # (B, w) bool: a real token sits there
    extras: tuple | None  # per-token write inputs of the memory, each (B, G, w, ...) (RSA: log decay; SSMs: u, B,
    # decay; VORT: key features, order); None before the first call
    memory: object  # the mixer's own state (anything ``map_tensors`` handles), None before the first write
    written: torch.Tensor  # (B,) tokens written into the memory so far
    oldest: torch.Tensor  # (B,) long: the slot of the oldest of the w positions (the next to leave the window)

    def map(self, fn) -> "WindowState":
        return WindowState(**{f.name: map_tensors(getattr(self, f.name), fn) for f in fields(self)})


def empty_window(keys: torch.Tensor, values: torch.Tensor, window: int) -> WindowState:
    """The state before the first token: w invalid positions, nothing written (the extras are shaped by the first
    call's)."""
    batch, groups = keys.shape[:2]
    return WindowState(keys=keys.new_zeros(batch, groups, window, keys.shape[-1]),
                       values=values.new_zeros(batch, groups, window, values.shape[-1]),
                       valid=torch.zeros(batch, window, dtype=torch.bool, device=keys.device), extras=None,
                       memory=None, written=torch.zeros(batch, dtype=torch.long, device=keys.device),
                       oldest=torch.zeros(batch, dtype=torch.long, device=keys.device))


def in_order(ring: torch.Tensor, oldest: torch.Tensor, dim: int) -> torch.Tensor:
    """A ring's w slots along ``dim`` (after the batch dimension 0) oldest first: row b from slot ``oldest[b]``."""
    window = ring.shape[dim]
    slots = (oldest[:, None] + torch.arange(window, device=ring.device)) % window  # (B, w)
    index = slots.view(slots.shape[0], *([1] * (dim - 1)), window, *([1] * (ring.dim() - dim - 1)))
    return ring.gather(dim, index.expand_as(ring))


def _writes_in_place(state: WindowState, keys, values, extras) -> bool:
    """Whether a token step may write into the state's ring buffers: not under autograd (the previous step's read
    of them may be saved for the backward pass), nor into inference tensors outside inference mode, nor in a
    compiled CUDA step (cudagraph trees replay no graph that mutates its inputs: the step would run without one), and
    the new token in the ring's dtypes."""
    if torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():  # (dynamo cannot trace the inference-tensor test below)
        if keys.device.type == "cuda":
            return False
    elif state.keys.is_inference() and not torch.is_inference_mode_enabled():
        return False
    return (state.keys.dtype == keys.dtype and state.values.dtype == values.dtype
            and (callable(extras) or all(old.dtype == new.dtype for old, new in zip(state.extras, extras))))


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
    # masked scores take a slow path for inputs below ~-88 (10-20x a softmax's time: 2/3 of this function's)
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
    delayed = combine != "sum"
    if length == 1 and state.extras is not None:  # a token step: the ring's slots in place of a shifted window
        local, local_log, entering, ring = _token_step(query, keys, values, valid, extras, state, scale, delayed)
    else:
        local, local_log, entering, ring = _block_step(query, keys, values, valid, extras, state, window, scale,
                                                       delayed)
    # what the memory writes this call: the tokens leaving the window (delayed), or the new ones
    writing = entering[2]
    remote, remote_log, memory_state = memory(query, entering[0], entering[1], writing, entering[3], state.memory)
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
    return out, replace(ring, memory=memory_state, written=state.written + writing.long().sum(1))


def _token_step(query, keys, values, valid, extras, state: WindowState, scale: float, delayed: bool):
    """One token (T = 1) through the ring: the leaving token's slot read, the new token written into it (in place
    where ``_writes_in_place``, else into a copy), attention over the ring -> the window's output and log
    normaliser, what the memory writes (keys, values, valid, extras), the new ring (memory and count left to the
    caller)."""
    rows = torch.arange(query.shape[0], device=query.device)
    slot = state.oldest  # (B,): the oldest token's, which leaves the window now
    in_place = _writes_in_place(state, keys, values, extras)

    def leaving(ring, dim):  # the slot's row, (B, G, 1, ...) or (B, 1): a copy, read before the slot is written
        return ring[rows, slot][:, None] if dim == 1 else ring[rows, :, slot][:, :, None]

    def with_new(ring, new, dim):  # the ring with the new token in the slot
        ring = ring if in_place else ring.to(new.dtype, copy=True)
        if dim == 1:
            ring[rows, slot] = new[:, 0]
        else:
            ring[rows, :, slot] = new[:, :, 0].to(ring.dtype)
        return ring

    left = (leaving(state.keys, 2), leaving(state.values, 2), leaving(state.valid, 1),
            tuple(leaving(e, 2) for e in state.extras))
    ring_keys, ring_values = with_new(state.keys, keys, 2), with_new(state.values, values, 2)
    ring_valid = with_new(state.valid, valid, 1)
    local, local_log, *entropy = ring_attention(query, ring_keys, ring_values, ring_valid, scale,
                                                with_entropy=callable(extras))
    new_extras = extras(entropy[0]) if callable(extras) else extras
    ring_extras = tuple(with_new(old, new, 2) for old, new in zip(state.extras, new_extras, strict=True))
    entering = left if delayed else (keys, values, valid, new_extras)
    ring = WindowState(keys=ring_keys, values=ring_values, valid=ring_valid, extras=ring_extras, memory=None,
                       written=None, oldest=(slot + 1) % state.valid.shape[1])
    return local, local_log, entering, ring


def _block_step(query, keys, values, valid, extras, state: WindowState, window: int, scale: float, delayed: bool):
    """T tokens through the block form (``window_attention`` over the ring in order, then the T new positions) ->
    what ``_token_step`` returns; the new ring holds the last w positions in order (its oldest in slot 0)."""
    length = query.shape[3]
    ordered = (lambda t, dim: t) if state.extras is None else \
        (lambda t, dim: in_order(t, state.oldest, dim))  # a new window's slots are in order (and all empty)
    keys = torch.cat([ordered(state.keys, 2).to(keys.dtype), keys], dim=2)  # (B, G, w + T, d): w + i is new token i
    values = torch.cat([ordered(state.values, 2).to(values.dtype), values], dim=2)
    valid = torch.cat([ordered(state.valid, 1), valid], dim=1)
    local, local_log, *entropy = window_attention(query, keys, values, valid, window, scale,
                                                  with_entropy=callable(extras))
    new_extras = extras(entropy[0]) if callable(extras) else extras
    old_extras = tuple(ordered(e, 2) for e in state.extras) if state.extras is not None else \
        tuple(e.new_zeros(e.shape[0], e.shape[1], window, *e.shape[3:]) for e in new_extras)
    extras = tuple(torch.cat([old.to(new.dtype), new], dim=2) for old, new in zip(old_extras, new_extras,
                                                                                     strict=True))
    # query i sees the memory after the write of position i: the token that has just left its window (delayed);
    # else the memory reads every token, the window on top
    span = slice(0, length) if delayed else slice(window, window + length)
    entering = (keys[:, :, span], values[:, :, span], valid[:, span], tuple(e[:, :, span] for e in extras))
    # the last w positions as dense tensors (w rows, not views into w + T): a compiled decode step writes them so
    # and its next call sees the strides it was compiled for, with no copy in between
    last = lambda t, dim: t.narrow(dim, length, window).clone(memory_format=torch.contiguous_format)  # noqa: E731
    ring = WindowState(keys=last(keys, 2), values=last(values, 2), valid=last(valid, 1),
                       extras=tuple(last(e, 2) for e in extras), memory=None, written=None,
                       oldest=torch.zeros_like(state.oldest))
    return local, local_log, entering, ring
