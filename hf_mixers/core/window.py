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
prefill, a training step) reads the ring in order, runs the window's attention over it and the new tokens
(kernels/local_attention.py: flex_attention on CUDA, a PyTorch block form elsewhere) and leaves a new ring.

Shapes: queries (B, G, g, T, d) (G KV heads of g query heads each), keys (B, G, T, d), values (B, G, T, dv),
valid (B, T) bool. The window is by position, as sliding-window attention is: with left padding (what
``generate`` uses) every row reads exactly what it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from ..kernels.conventions import kept_by_state, shape_constant
from ..kernels.local_attention import local_attention, ring_attention
from ..kernels.window_combine import combine_reads
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


def in_order(ring: torch.Tensor, oldest: torch.Tensor, dim: int) -> torch.Tensor:
    """A ring's w slots along ``dim`` (after the batch dimension 0) oldest first: row b from slot ``oldest[b]``."""
    window = ring.shape[dim]
    slots = (oldest[:, None] + torch.arange(window, device=ring.device)) % window  # (B, w)
    index = slots.view(slots.shape[0], *([1] * (dim - 1)), window, *([1] * (ring.dim() - dim - 1)))
    return ring.gather(dim, index.expand_as(ring))


def _writes_in_place(state: WindowState, keys, values, extras) -> bool:
    """Whether a token step may write into the state's ring buffers: not under autograd (the previous step's read
    of them may be saved for the backward pass), nor into a ring a prefill under autograd left as views of its
    tensors (``kept_by_state``), nor into inference tensors outside inference mode, nor in a compiled CUDA step
    (cudagraph trees replay no graph that mutates its inputs: the step would run without one), and the new token in
    the ring's dtypes."""
    if torch.is_grad_enabled() or any(t.requires_grad for t in (state.keys, state.values, *state.extras)):
        return False
    if torch.compiler.is_compiling():  # (dynamo cannot trace the inference-tensor test below)
        if keys.device.type == "cuda":
            return False
    elif state.keys.is_inference() and not torch.is_inference_mode_enabled():
        return False
    return (state.keys.dtype == keys.dtype and state.values.dtype == values.dtype
            and (callable(extras) or all(old.dtype == new.dtype for old, new in zip(state.extras, extras))))


# memory(query, keys, values, valid, extras, memory_state) -> (output (B, G, g, T, dv), log weight (B, G, g, T) or
# None, new memory state): the mixer's constant-state read after writing, at each step, the token leaving the window
# (or, for the additive combinations, the new token itself)
Memory = Callable[..., tuple]


def windowed(query, keys, values, valid, extras, state: WindowState | None, window: int, scale: float,
             memory: Memory, gate: torch.Tensor | None = None, combine: str | None = None, backend: str = "auto"):
    """The mixer's output with a local window of ``window`` tokens in front of ``memory`` -> (B, G, g, T, dv) and
    the new ``WindowState``.

    ``extras``: per-token write inputs (B, G, T, ...) the memory receives with its token, or a function of the
    window's normalised entropy (B, G, g, T) returning them (VORT's order reads it). ``combine``:
        "shared"     one normaliser over window and memory (the memory returns its log weight); writes delayed
        "convex"     window + sigmoid(gate) (memory - window); writes delayed
        "gated_sum"  window + sigmoid(gate) memory; writes delayed
        "sum"        window + memory, the memory reading every token (its writes not delayed: VORT's eq. 17)
    None: "shared" when the memory returns a log weight, else "convex". ``gate`` (G, g): per-head logits.
    ``backend``: the window attention's and the combine's path, as ``config.kernel_backend``
    (kernels/local_attention.py, kernels/window_combine.py).
    """
    length = query.shape[3]
    if valid is None:  # every token real: built once a shape (never part of a state, which a decode writes in place)
        valid = shape_constant(("every token real", query.shape[0], length, str(query.device)),
                               lambda: torch.ones(query.shape[0], length, dtype=torch.bool, device=query.device))
    delayed = combine != "sum"
    if length == 1 and state is not None:  # a token step: the ring's slots in place of a shifted window
        local, local_log, entering, ring = _token_step(query, keys, values, valid, extras, state, scale, delayed)
    else:
        local, local_log, entering, ring = _block_step(query, keys, values, valid, extras, state, window, scale,
                                                       delayed, backend)
    # what the memory writes this call: the tokens leaving the window (delayed), or the new ones
    writing = entering[2]
    remote, remote_log, memory_state = memory(query, entering[0], entering[1], writing, entering[3],
                                              None if state is None else state.memory)
    if combine == "sum":
        out = local + remote.to(local.dtype)
    else:
        # a query whose leaving token is padding reads the window alone (with left padding its memory is empty); one
        # whose leaving token is real has it in the memory
        combine = combine or ("shared" if remote_log is not None else "convex")
        out = combine_reads(local, local_log, remote, remote_log, writing, combine, gate, backend)
    written = writing.sum(1)  # (a sum of flags is int64)
    return out, replace(ring, memory=memory_state, written=written if state is None else state.written + written)


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


def _block_step(query, keys, values, valid, extras, state: WindowState | None, window: int, scale: float,
                delayed: bool, backend: str):
    """T tokens through the block form (``local_attention`` over the ring in order, then the T new positions) ->
    what ``_token_step`` returns; the new ring holds the last w positions in order (its oldest in slot 0). Without
    a state (a first call) the w positions before the call are padding."""
    length = query.shape[3]

    def with_earlier(new, ring, dim):  # (B, [G,] w + T, ...): the ring's w positions in order, then the new ones
        if ring is None:
            return torch.nn.functional.pad(new, (0, 0) * (new.dim() - dim - 1) + (window, 0))
        return torch.cat([in_order(ring, state.oldest, dim).to(new.dtype), new], dim)

    rings = (None, None, None) if state is None else (state.keys, state.values, state.valid)
    keys, values, valid = (with_earlier(t, ring, dim) for t, ring, dim in zip((keys, values, valid), rings, (2, 2, 1)))
    local, local_log, *entropy = local_attention(query, keys, values, valid, window, scale,
                                                 with_entropy=callable(extras), backend=backend)
    new_extras = extras(entropy[0]) if callable(extras) else extras
    old_extras = (None,) * len(new_extras) if state is None else state.extras
    extras = tuple(with_earlier(new, old, 2) for new, old in zip(new_extras, old_extras, strict=True))
    # query i sees the memory after the write of position i: the token that has just left its window (delayed);
    # else the memory reads every token, the window on top
    span = slice(0, length) if delayed else slice(window, window + length)
    entering = (keys[:, :, span], values[:, :, span], valid[:, span], tuple(e[:, :, span] for e in extras))
    # the last w positions (a prefill's as dense tensors of w rows, not views into w + T: a compiled decode step
    # writes them so, and its next call sees the strides it was compiled for, with no copy in between)
    last = lambda t, dim: kept_by_state(t.narrow(dim, length, window))  # noqa: E731
    ring = WindowState(keys=last(keys, 2), values=last(values, 2), valid=last(valid, 1),
                       extras=tuple(last(e, 2) for e in extras), memory=None, written=None,
                       oldest=torch.zeros(query.shape[0], dtype=torch.long, device=query.device))
    return local, local_log, entering, ring
