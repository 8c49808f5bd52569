"""The RSA memory's state and parameters, and its write side: what the PyTorch forms (kernels/rsa_memory.py, where
the math is written out) and the Triton chunk read (kernels/rsa_chunk_triton.py) share.

The state is mass-weighted sums per KV head, normalised only when read; ``write_chunks`` adds the writes of every
chunk of an aligned buffer (``ChunkLayout``), in order, with the references refreshed at each chunk boundary.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F

from .conventions import kept_by_state, own_code, packed_zeros, shape_constant


@dataclass
class ResidualMLPWeights:
    """x + down(silu(up(x))) from plain tensors, so a compiled step sees tensors (graph inputs), not modules."""

    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor

    def __call__(self, x):
        hidden = F.silu(F.linear(x, self.up_weight, self.up_bias))
        return x + F.linear(hidden, self.down_weight, self.down_bias)


@dataclass
class RSAParams:
    """The tensors and options one layer's memory needs (built by the mixer from its parameters)."""

    prototypes: torch.Tensor  # (G, L, m, d) initial key slots P
    kappa: torch.Tensor  # (G, L) pseudo-count of P, >= 0
    beta: torch.Tensor  # (G, L) assignment inverse temperature
    key_mlps: list[Callable]  # L - 1 maps d -> d
    value_mlps: list[Callable]  # L - 1 maps dv -> dv
    read_proj: torch.Tensor  # W   (H, L, m, m)
    mix_proj: torch.Tensor  # W_r (H, L, m, m)
    threshold: torch.Tensor  # theta = 1/z, (H, L), as learned: read clamped to [0, threshold_max] (``theta``)
    read_scale: torch.Tensor  # w_a (H, L)
    query_read: torch.Tensor | None  # W_qr (H, L, d, m), the RSA-q branch
    assign_fn: str = "softmax"  # softmax | sigmoid
    readout: str = "sigmoid"  # sigmoid | softmax_count
    routing: str = "relation"  # relation | elementwise | none
    chunk_size: int = 64
    eps: float = 1e-6
    recompute: bool = False  # training: keep only chunk inputs, recompute each chunk in the backward pass
    log_weight: bool = False  # append each read's log weight as one more output channel (the local window's merge)
    refresh_in_step: bool = True  # the token step refreshes the references at a boundary (False: its caller does)
    compile_write: bool | str = False  # the chunk forms write each chunk through one torch.compile graph
    # (compiled_write): True ("default") or a torch.compile mode ("reduce-overhead": replayed as a CUDA graph)
    threshold_max: float = math.inf  # theta's upper clamp

    def theta(self) -> torch.Tensor:
        """The sparse read's threshold as read, (H, L): the learned one clamped to [0, threshold_max] (the read
        kernels clamp it themselves, and pass its gradient where the clamp does)."""
        return self.threshold.clamp(0.0, self.threshold_max)


@dataclass
class RSAState:
    key_sum: torch.Tensor
    value_sum: torch.Tensor
    mass: torch.Tensor
    relation_sum: torch.Tensor
    key_ref: torch.Tensor
    value_ref: torch.Tensor
    count: torch.Tensor

    def map(self, fn) -> "RSAState":
        """Apply ``fn`` to every tensor (batch selection, beam reordering, device moves)."""
        return RSAState(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in fields(self)))


def initial_state(params: RSAParams, batch: int, value_dim: int, dtype: torch.dtype) -> RSAState:
    groups, levels, slots, key_dim = params.prototypes.shape
    prototypes = params.prototypes.to(dtype).expand(batch, -1, -1, -1, -1)
    # the sums and value references: views of one zero fill
    _, (key_sum, value_sum, mass, relation_sum, value_ref) = packed_zeros(
        [prototypes.shape, (batch, groups, levels, slots, value_dim), (batch, groups, levels, slots),
         (batch, groups, max(levels - 1, 0), slots, slots), (batch, groups, levels, slots, value_dim)],
        prototypes.device, dtype)
    return RSAState(key_sum=key_sum, value_sum=value_sum, mass=mass, relation_sum=relation_sum, key_ref=prototypes,
                    value_ref=value_ref, count=torch.zeros(batch, dtype=torch.long, device=prototypes.device))


def assign(x_k, key_ref, beta, params, tau):
    """Slot assignment f (written mass) and residual weights p, both (..., m). x_k (..., R, d), key_ref (..., m, d)."""
    scores = tau * torch.matmul(x_k, key_ref.transpose(-1, -2))
    if params.assign_fn == "softmax":
        f = torch.softmax(beta * scores, dim=-1)
        return f, f
    return torch.sigmoid(beta * scores), torch.softmax(scores, dim=-1)


def readout_activation(x, level, mass, params):
    """Readout activation of ``x = tau q.SK`` (..., m); ``mass`` broadcastable to it (level 0 count prior)."""
    if params.readout == "sigmoid":
        return torch.sigmoid(x)
    if level == 0:
        x = x + torch.log(mass.clamp_min(params.eps))
    return torch.softmax(x, dim=-1)


def per_head(tensor, groups):
    """(H, ...) -> (G, g, ...) so that query head h reads KV head h // g."""
    return tensor.unflatten(0, (groups, -1))


def slot_prior(params: RSAParams, dtype):
    """kappa * P (1, G, L, m, d) and kappa (1, G, L, 1): the non-decaying pseudo-observations of the key slots."""
    kappa = params.kappa.to(dtype)[None, :, :, None]
    return kappa[..., None] * params.prototypes.to(dtype)[None], kappa


def decayed(state: RSAState, factor) -> RSAState:
    """The data sums times ``factor`` (B, G); the prototype prior, references and count never decay."""
    scale = factor[:, :, None, None]
    return replace(state, key_sum=state.key_sum * scale[..., None], value_sum=state.value_sum * scale[..., None],
                   mass=state.mass * scale, relation_sum=state.relation_sum * scale[..., None])


def refresh_references(state: RSAState, params: RSAParams, rows, skip_if_none: bool = True) -> RSAState:
    """Set the references to the current slots for the batch rows in ``rows`` (bool (B,)).

    ``skip_if_none``: look whether any row is at a boundary first and do nothing if none is: one host read, worth it
    in the token step, where most steps are not at one. The chunk forms pass False: nearly every chunk ends at a
    boundary, and on a GPU each host read would stall the queue of launches (8 per layer at T = 512)."""
    if skip_if_none and not torch.compiler.is_compiling() and not bool(rows.any()):
        return state  # most decode steps: no row is at a boundary (one host sync saves the work; not when compiled)
    prior, kappa = slot_prior(params, state.mass.dtype)
    key_now = (prior + state.key_sum) / (kappa + state.mass).clamp_min(params.eps)[..., None]
    value_now = state.value_sum / state.mass.clamp_min(params.eps)[..., None]
    where = rows[:, None, None, None, None]
    return replace(state, key_ref=torch.where(where, key_now, state.key_ref),
                   value_ref=torch.where(where, value_now, state.value_ref))


def decay_total(log_decay_c, write, dtype):
    """Lambda_t: the cumulative log decay inside a chunk (..., C); padding (``write`` 0) never decays."""
    return (log_decay_c.to(dtype) * write).cumsum(-1)


def decay_masks(log_decay_c, write, size, device, dtype):
    """``carry[t, s]``: how much of what row s wrote row t still sees (the inclusive causal mask, times the decay in
    between, exp(Lambda_t - Lambda_s)); ``start[t]``: how much of the chunk-start state row t still sees.

    No decay: carry (C, C), start (C,). Decay (``log_decay_c`` (B, G, ..., C)): carry (B, G, ..., C, C),
    start (B, G, ..., C); padding never decays (``write`` broadcastable to ``log_decay_c``).
    """
    causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()  # inclusive: token t reads itself
    if log_decay_c is None:
        return causal.to(dtype), torch.ones(size, dtype=dtype, device=device)
    total = decay_total(log_decay_c, write, dtype)
    gap = (total[..., :, None] - total[..., None, :]).masked_fill(~causal, float("-inf"))
    return torch.exp(gap), torch.exp(total)


def write_chunk(k_c, v_c, valid_c, state: RSAState, params: RSAParams, log_decay_c=None):
    """Write side of one aligned chunk (steps 1-2 and 7 of a chunk): k_c (B, G, C, d), v_c (B, G, C, dv),
    valid_c (B, C), log_decay_c (B, G, C) or None.

    Assignments run against the references of the last boundary, level by level (each level writes the MLP residual
    of the one above). Returns F, X, Y (B, G, L, C, m | d | dv): every row's assignment, key and value per level,
    and the state with the chunk's writes added (references untouched, count not advanced).
    """
    levels = params.prototypes.shape[1]
    tau = params.prototypes.shape[-1] ** -0.5
    write = valid_c.to(k_c.dtype)[:, None, :, None]  # (B, 1, C, 1): padding writes nothing
    x_k, x_v = k_c, v_c
    assignments, keys, values = [], [], []
    for i in range(levels):
        key_ref, value_ref = state.key_ref[:, :, i], state.value_ref[:, :, i]
        f, p = assign(x_k, key_ref, params.beta[None, :, i, None, None].to(k_c.dtype), params, tau)
        assignments.append(f * write)
        keys.append(x_k)
        values.append(x_v)
        if i < levels - 1:
            x_k = params.key_mlps[i](x_k - p @ key_ref)
            x_v = params.value_mlps[i](x_v - p @ value_ref)
    f, x, y = torch.stack(assignments, 2), torch.stack(keys, 2), torch.stack(values, 2)
    weighed = f  # each row's write as the chunk end sees it
    if log_decay_c is not None:
        total = decay_total(log_decay_c, write[..., 0], k_c.dtype)  # (B, G, C)
        weighed = f * torch.exp(total[..., -1:] - total)[:, :, None, :, None]  # the decay from row s to the chunk end
        state = decayed(state, torch.exp(total[..., -1]))  # the chunk-start sums, decayed over the whole chunk
    weighed_t = weighed.transpose(-1, -2)  # (B, G, L, m, C)
    relation = weighed_t[:, :, :-1] @ f[:, :, 1:] if levels > 1 else 0.0
    state = replace(state, key_sum=state.key_sum + weighed_t @ x, value_sum=state.value_sum + weighed_t @ y,
                    mass=state.mass + weighed.sum(-2), relation_sum=state.relation_sum + relation)
    return f, x, y, state


@dataclass
class ChunkLayout:
    """Each row's real tokens packed into an aligned buffer at offset ``count % C`` (the row's phase), so every
    row's chunk boundaries fall on multiples of C in the buffer whatever its padding or cached length. Shared by the
    PyTorch chunk form and the Triton one (kernels/rsa_chunk_triton.py).

    Built without reading the device where the buffer's length is known from the shapes: a fresh state (every count
    0, ``fresh``) puts every row's tokens from offset 0, so ceil(T / C) chunks hold them; the training step and a
    first prefill. Without padding too, every tensor of the layout depends on the shapes alone, and is built once a
    shape (``static``: the buffer's valid rows and the boundary index, none of them a launch of the step). A state
    with history needs its phases' largest span: one host read."""

    phase: torch.Tensor  # (B,) buffer offset of each row's first new token
    real: torch.Tensor  # (B,) real tokens of each row in this call
    padded: int  # buffer length, a multiple of C
    slot: torch.Tensor | None  # (B, T) each token's buffer position (padding: ``padded``); None: its own position
    source: torch.Tensor | None  # (B, padded) the token each buffer position holds (empty ones: T, none)
    static: tuple | None = None  # a fresh unpadded call's (valid rows (B, padded), boundary index (B, N + 1))

    @classmethod
    def of(cls, valid: torch.Tensor | None, count: torch.Tensor, size: int, length: int,
           fresh: bool = False) -> "ChunkLayout":
        """valid (B, T) bool or None (every token real), count (B,) tokens before this call, T = ``length``."""
        if fresh and valid is None:  # the buffer is the sequence itself, filled up to a whole chunk
            batch, padded = count.shape[0], -(-length // size) * size

            def build():  # the plain layout's own tensors, kept
                plain = cls(torch.zeros_like(count), torch.full_like(count, length), padded, None, None)
                return plain.phase, plain.real, plain.valid(batch, count.device), boundary_index(plain, size)

            phase, real, *static = shape_constant(("rsa layout", batch, length, size, count.dtype, str(count.device)),
                                                  build)
            return cls(phase, real, padded, None, None, tuple(static))
        if valid is None:
            valid = torch.ones(count.shape[0], length, dtype=torch.bool, device=count.device)
        phase, written = count % size, valid.long().cumsum(1)
        real = written[:, -1] if length else torch.zeros_like(count)
        span = length if fresh else (int((phase + real).max().item()) if length else 0)
        padded = -(-span // size) * size
        slot = torch.where(valid, phase[:, None] + written - 1, padded)
        source = torch.full((count.shape[0], padded + 1), length, dtype=torch.long, device=count.device)
        times = torch.arange(length, device=count.device).expand_as(slot)
        source = source.scatter(1, slot, times)[:, :padded]  # padding lands in the dropped column
        return cls(phase, real, padded, slot, source)

    def pack(self, x: torch.Tensor, time_dim: int) -> torch.Tensor:
        """The real tokens of ``x`` (time on ``time_dim``) in the buffer, contiguous (one copy of a view, not one per
        kernel that reads it); filler is 0."""
        length = x.shape[time_dim]
        if self.slot is None:
            if self.padded == length:
                return x.contiguous()
            return F.pad(x, (0, 0) * (x.dim() - 1 - time_dim) + (0, self.padded - length))
        moved = x.movedim(time_dim, 1)  # time next to batch
        rows = torch.arange(moved.shape[0], device=x.device)[:, None]
        taken = moved[rows, self.source.clamp_max(max(length - 1, 0))]
        empty = (self.source == length).view(*self.source.shape, *(1,) * (moved.dim() - 2))
        return taken.masked_fill(empty, 0).movedim(1, time_dim)

    def valid(self, batch: int, device) -> torch.Tensor:
        """(B, buffer) True where a real token sits."""
        if self.static is not None:
            return self.static[0]
        if self.slot is None:
            return (torch.arange(self.padded, device=device) < self.real[:, None])
        return self.source < self.slot.shape[1]

    def unpack(self, out_b: torch.Tensor, length: int) -> torch.Tensor:
        """Buffer outputs (B, G, g, buffer, dv) back to (B, G, g, T, dv); padded positions get 0."""
        if self.slot is None:
            return out_b[:, :, :, :length]
        moved = out_b.movedim(3, 1)
        rows = torch.arange(moved.shape[0], device=out_b.device)[:, None]
        taken = moved[rows, self.slot.clamp_max(self.padded - 1)]
        padding = (self.slot == self.padded).view(*self.slot.shape, *(1,) * (moved.dim() - 2))
        return taken.masked_fill(padding, 0).movedim(1, 3)


@dataclass
class ChunkWrites:
    """What the write side of every chunk hands the read side (N chunks of C rows, Tp = N * C buffer rows)."""

    f: torch.Tensor  # (B, G, L, Tp, m) every row's assignment per level (0 for padding)
    x: torch.Tensor  # (B, G, L, Tp, d) the key each level wrote (level 0: k; deeper: MLP residuals)
    y: torch.Tensor  # (B, G, L, Tp, dv) the value each level wrote
    key_sum: torch.Tensor  # (B, G, N, L, m, d) the sums at each chunk's start ...
    value_sum: torch.Tensor  # (B, G, N, L, m, dv)
    mass: torch.Tensor  # (B, G, N, L, m)
    relation_sum: torch.Tensor  # (B, G, N, L - 1, m, m)
    # the same four sums at every boundary, (B, G, N + 1, L, ...), where the write made them so (``write_chunks``):
    # the chunk starts above are their views; the kernels' read takes them whole, so no copy of the starts is made
    every_boundary: tuple | None = None

    def rows(self, start: int, stop: int, size: int) -> "ChunkWrites":
        """The writes of buffer rows [start, stop), whole chunks of ``size`` rows (a group of chunks to read)."""
        chunks = slice(start // size, -(-stop // size))
        return ChunkWrites(self.f[:, :, :, start:stop], self.x[:, :, :, start:stop], self.y[:, :, :, start:stop],
                           *(t[:, :, chunks] for t in (self.key_sum, self.value_sum, self.mass, self.relation_sum)))


def write_and_refresh(k_c, v_c, valid_c, state: RSAState, params: RSAParams, log_decay_c, reached):
    """``write_chunk``, then the references refreshed for the rows in ``reached`` (bool (B,): their tokens reach the
    chunk's end): one chunk of ``write_chunks``, the unit ``compiled_write`` compiles (no host read: the refresh runs
    for every row, a no-op where ``reached`` is False)."""
    f, x, y, state = write_chunk(k_c, v_c, valid_c, state, params, log_decay_c)
    return f, x, y, refresh_references(state, params, reached, skip_if_none=False)


@functools.cache
def compiled_write(mode: str = "default"):
    """``write_and_refresh`` as one torch.compile graph (``params.compile_write``, the mixer's ``rsa_compile_write``)
    in torch.compile's ``mode``.

    Eager, a chunk's write side is ~300 small operator calls forward and backward at 4 levels (an assignment, two
    residual projections and two MLPs per level, the state sums, the refresh, and autograd's backward of each): on a
    GPU each is a kernel launch, and the step is bound by them, not by arithmetic (docs/benchmarks.md, "The fourth
    GPU run"). Compiled, the elementwise work fuses into a few kernels and the matmuls stay; "reduce-overhead"
    replays each chunk's forward and backward as CUDA graphs on CUDA (every chunk of a step a node of cudagraph
    trees, recorded at the first steps), so what is left of the launches costs no host time (on a CPU it is the
    default mode: no graph to replay). One graph per input shape and grad mode, shared by every layer and chunk (the
    weights are its inputs, not constants); built at the first call (tens of seconds), then looked up."""
    return torch.compile(own_code(write_and_refresh), fullgraph=True, mode=None if mode == "default" else mode)


def write_chunks_in_order(k_b, v_b, valid_b, layout: ChunkLayout, state: RSAState, params: RSAParams, decay_b=None):
    """The write side of every chunk of the aligned buffer, one chunk after the other: k_b (B, G, Tp, d),
    v_b (B, G, Tp, dv), valid_b (B, Tp), decay_b (B, G, Tp) or None -> (ChunkWrites, the state after the last chunk,
    count advanced). The buffer holds at least one chunk.

    The reference of ``write_chunks`` (the literal order of the math: a chunk assigns against the references
    refreshed at the previous boundary, then writes), and its path with decay or ``params.compile_write``.
    """
    size = params.chunk_size
    mode = params.compile_write
    write = compiled_write("default" if mode is True else mode) if mode else write_and_refresh
    f, x, y, starts = [], [], [], []
    for start in range(0, layout.padded, size):
        stop = start + size
        starts.append(state)
        reached = layout.phase + layout.real >= stop  # the rows whose tokens reach this boundary
        f_c, x_c, y_c, state = write(k_b[:, :, start:stop], v_b[:, :, start:stop], valid_b[:, start:stop], state,
                                     params, None if decay_b is None else decay_b[:, :, start:stop], reached)
        f.append(f_c)
        x.append(x_c)
        y.append(y_c)
    state = replace(state, count=state.count + layout.real)
    sums = (torch.stack([getattr(s, name) for s in starts], 2)
            for name in ("key_sum", "value_sum", "mass", "relation_sum"))
    return ChunkWrites(torch.cat(f, 3), torch.cat(x, 3), torch.cat(y, 3), *sums), state


def boundary_index(layout: ChunkLayout, size: int) -> torch.Tensor:
    """(B, N + 1): which boundary's slots each row's references hold at each chunk start c = 0..N (N: after the last
    chunk): min(c, boundaries the row reaches), 0 the state's own references. A row refreshes them at every boundary
    its tokens reach; past its last one it writes nothing, and they stay."""
    if layout.static is not None:
        return layout.static[1]
    reached = (layout.phase + layout.real) // size
    return torch.minimum(torch.arange(layout.padded // size + 1, device=reached.device), reached[:, None])


def assign_chain(x, valid, key_sum, mass, key_ref, prior, kappa, beta, boundary, params: RSAParams):
    """One level's key-assignment chain over every chunk, in order: the write side's only nonlinear recurrence.

    x (B, G, Tp, d) the level's keys, valid (B, Tp) 1 / 0 (or bool), the level's state at the buffer's start
    key_sum (B, G, m, d), mass (B, G, m), key_ref (B, G, m, d); prior = kappa P (G, m, d), kappa (G,), beta (G,);
    boundary (B, N + 1) from ``boundary_index``. Chunk c assigns its rows against ref_c, the slots
    (kappa P + S_j) / (kappa + n_j) of boundary j = boundary[:, c] (j = 0: key_ref), and writes
    S_{c+1} = S_c + F_c^T X_c, n_{c+1} = n_c + sum_t F_c.
    Returns f (B, G, Tp, m) every row's assignment (F = f * valid is what it writes), p (B, G, Tp, m) the residual
    weights (f itself for softmax assignment), and the sums at every boundary S (B, G, N + 1, m, d),
    n (B, G, N + 1, m).

    The PyTorch twin of kernels/rsa_chain_triton.py's kernel (the CPU path and its oracle): one loop over chunks.
    """
    size, tau, eps = params.chunk_size, x.shape[-1] ** -0.5, params.eps
    write = valid.to(x.dtype)[:, None, :, None]
    prior, kappa, beta = prior[None], kappa[None, :, None], beta[None, :, None, None]
    sums, masses, fs, ps = [key_sum], [mass], [], []
    ref = key_ref
    for index, start in enumerate(range(0, x.shape[2], size)):
        if index:  # refreshed at this boundary for the rows that reach it
            now = (prior + key_sum) / (kappa + mass).clamp_min(eps)[..., None]
            ref = torch.where((boundary[:, index] == index)[:, None, None, None], now, ref)
        x_c = x[:, :, start:start + size]
        f, p = assign(x_c, ref, beta, params, tau)
        written = f * write[:, :, start:start + size]
        key_sum, mass = key_sum + written.transpose(-1, -2) @ x_c, mass + written.sum(-2)
        sums.append(key_sum)
        masses.append(mass)
        fs.append(f)
        ps.append(p)
    f = torch.cat(fs, 2)
    return f, (f if params.assign_fn == "softmax" else torch.cat(ps, 2)), torch.stack(sums, 2), torch.stack(masses, 2)


def exclusive_sums(start, increments):
    """start (B, G, ...) and per-chunk increments (B, G, N, ...) -> the running sum at every boundary
    (B, G, N + 1, ...): start, start + inc_0, ..., start + inc_0 + ... + inc_{N-1}."""
    return torch.cat([start[:, :, None], start[:, :, None] + increments.cumsum(2)], 2)


def references(start, sums, divisor, source, eps):
    """The references at every chunk start and after the last chunk (B, G, N + 1, m, d): the state's own ``start``
    (B, G, m, d) at boundary 0, else sums_j / max(divisor_j, eps) (sums (B, G, N + 1, m, d), divisor
    (B, G, N + 1, m)) of the row's boundary j (``boundary_index``), gathered from [start, slots_0 .. slots_N] at
    ``source`` (B, N + 1) = 0 where j = 0, else j + 1: nothing is sliced (a slice costs autograd a kernel of its own
    in the backward pass)."""
    slots = torch.cat([start[:, :, None], sums / divisor[..., None].clamp_min(eps)], 2)
    return slots.gather(2, source[:, None, :, None, None].expand(-1, slots.shape[1], -1, *slots.shape[-2:]))


def level_writes(f, p, x, y, valid, key_sum, mass, start_value_sum, start_key_ref, start_value_ref, prior, kappa,
                 boundary, params: RSAParams, f_above=None, start_relation_sum=None, residual=True):
    """Everything of one level's write but its chain, over all chunks at once (``assign_chain``'s results given).

    f, p (B, G, Tp, m) the chain's assignments and residual weights, x (B, G, Tp, d) and y (B, G, Tp, dv) the keys
    and values the level writes, valid (B, Tp) 1 / 0, key_sum (B, G, N + 1, m, d) and mass (B, G, N + 1, m) the
    chain's sums at every boundary; the level's state at the buffer's start (value sum (B, G, m, dv), references
    (B, G, m, d | dv)); prior = kappa P (G, m, d), kappa (G,); boundary from ``boundary_index``; f_above
    (B, G, Tp, m) the written assignments of the level above and its relation sum at the start (B, G, m, m), or
    None at level 0. Returns

        F = f . valid (what the level writes), V (B, G, N + 1, m, dv) the value sums at every boundary,
        R (B, G, N + 1, m, m) the relation sums F_above^T F (None at level 0),
        the next level's inputs x - p @ ref_k, y - p @ ref_v (chunk c against the references of its start;
        None unless ``residual``), and the references after the last chunk (B, G, m, d | dv).

    The references of chunk start c are ref_k = (kappa P + S_j) / max(kappa + n_j, eps), ref_v = V_j / max(n_j, eps)
    of the row's boundary j = boundary[:, c] (j = 0: the state's own). The PyTorch twin of
    kernels/rsa_chain_triton.py's level kernel.
    """
    size, eps = params.chunk_size, params.eps
    count = x.shape[2] // size
    chunked = lambda t: t.unflatten(2, (count, size))  # noqa: E731  (B, G, Tp, ...) -> (B, G, N, C, ...)
    source = torch.where(boundary > 0, boundary + 1, 0)  # where ``references`` finds each chunk start's slots
    written = f * valid[:, None, :, None]
    value_sum = exclusive_sums(start_value_sum, chunked(written).transpose(-1, -2) @ chunked(y))
    relation_sum = None if f_above is None else exclusive_sums(
        start_relation_sum, chunked(f_above).transpose(-1, -2) @ chunked(written))
    key_ref = references(start_key_ref, prior[None, :, None] + key_sum, kappa[None, :, None, None] + mass, source,
                         eps)  # (B, G, N + 1, m, d)
    value_ref = references(start_value_ref, value_sum, mass, source, eps)
    x_next = y_next = None
    if residual:
        p_c = chunked(p)
        x_next = x - (p_c @ key_ref[:, :, :count]).flatten(2, 3)
        y_next = y - (p_c @ value_ref[:, :, :count]).flatten(2, 3)
    return written, value_sum, relation_sum, x_next, y_next, key_ref[:, :, -1], value_ref[:, :, -1]


def residual_mlps(key_mlp: ResidualMLPWeights, value_mlp: ResidualMLPWeights, x, y):
    """A level's two residual MLPs: the next level's keys and values (the twin of kernels/rsa_mlp_triton.py)."""
    return key_mlp(x), value_mlp(y)


def write_chunks(k_b, v_b, valid_b, layout: ChunkLayout, state: RSAState, params: RSAParams, decay_b=None,
                 chain=assign_chain, level=level_writes, mlps=residual_mlps, priors=None):
    """The write side of every chunk of the aligned buffer: k_b (B, G, Tp, d), v_b (B, G, Tp, dv), valid_b (B, Tp),
    decay_b (B, G, Tp) or None -> (ChunkWrites, the state after the last chunk, count advanced). The buffer holds at
    least one chunk. Equal to ``write_chunks_in_order``.

    Split along the one recurrence: a level's assignments (``chain``: ``assign_chain`` or its Triton kernel) depend
    on its chunk-start key sums and mass, and once they are known everything else is a product over all chunks at
    once (``level``: ``level_writes`` or its kernel): the value sums and relation sums, the references of every
    chunk start, and the next level's keys and values (``mlps``: the residual MLPs, one call for all chunks). So the
    op count does not grow with T. With decay or ``params.compile_write``: ``write_chunks_in_order``. ``priors``:
    ``slot_prior(params, k_b.dtype)`` where the caller has it (its read adds kappa P too), else made here.
    """
    if decay_b is not None or params.compile_write:
        return write_chunks_in_order(k_b, v_b, valid_b, layout, state, params, decay_b)
    levels = params.prototypes.shape[1]
    prior, kappa = priors or slot_prior(params, k_b.dtype)  # (1, G, L, m, d), (1, G, L, 1)
    boundary = boundary_index(layout, params.chunk_size)
    written_rows = valid_b.to(k_b.dtype)  # (B, Tp) 1 where a real token sits
    x_k, x_v = k_b, v_b
    # each level's share of the state and parameters, unbound once (one stack in the backward, not a select a level)
    start = {name: getattr(state, name).unbind(2) for name in ("key_sum", "value_sum", "mass", "relation_sum",
                                                                "key_ref", "value_ref")}
    priors, kappas, betas = prior[0].unbind(1), kappa[0, :, :, 0].unbind(1), params.beta.to(k_b.dtype).unbind(1)
    fs, xs, ys, key_sums, value_sums, masses, relations, key_refs, value_refs = ([] for _ in range(9))
    for i in range(levels):
        f, p, key_sum, mass = chain(x_k, written_rows, start["key_sum"][i], start["mass"][i], start["key_ref"][i],
                                    priors[i], kappas[i], betas[i], boundary, params)
        above = (fs[-1], start["relation_sum"][i - 1]) if i else (None, None)
        f, value_sum, relation, x_next, y_next, key_ref, value_ref = level(
            f, p, x_k, x_v, written_rows, key_sum, mass, start["value_sum"][i], start["key_ref"][i],
            start["value_ref"][i], priors[i], kappas[i], boundary, params, *above, residual=i < levels - 1)
        for parts, part in zip((fs, xs, ys, key_sums, value_sums, masses, key_refs, value_refs),
                               (f, x_k, x_v, key_sum, value_sum, mass, key_ref, value_ref)):
            parts.append(part)
        if i:
            relations.append(relation)
        if i < levels - 1:  # the next level writes the residuals' MLPs, every chunk at once
            x_k, x_v = mlps(params.key_mlps[i], params.value_mlps[i], x_next, y_next)
    count = k_b.shape[2] // params.chunk_size
    key_sum, value_sum, mass = (torch.stack(t, 3) for t in (key_sums, value_sums, masses))  # (B, G, N + 1, L, ...)
    relation_sum = torch.stack(relations, 3) if relations else state.relation_sum[:, :, None].expand(
        -1, -1, count + 1, -1, -1, -1)
    # the sums after the last boundary (as views they would hold every boundary's sums, N + 1 times the state)
    last = lambda t: kept_by_state(t[:, :, -1])  # noqa: E731
    final = RSAState(key_sum=last(key_sum), value_sum=last(value_sum), mass=last(mass),
                     relation_sum=last(relation_sum), key_ref=torch.stack(key_refs, 2),
                     value_ref=torch.stack(value_refs, 2), count=state.count + layout.real)
    writes = ChunkWrites(torch.stack(fs, 2), torch.stack(xs, 2), torch.stack(ys, 2), key_sum[:, :, :-1],
                         value_sum[:, :, :-1], mass[:, :, :-1], relation_sum[:, :, :-1],
                         every_boundary=(key_sum, value_sum, mass, relation_sum))
    return writes, final
