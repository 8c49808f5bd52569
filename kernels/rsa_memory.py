"""RSA memory (docs/mixers/rsa.md): the exact token recurrence and its chunk-parallel form.

Per KV head, ``L`` levels of ``m`` slots. The state is kept as mass-weighted sums and normalised only when read:

    key_sum   (B, G, L, m, d)   sum_t f_t k_t                 -> key slots   SK = (kappa P + key_sum) / (kappa + mass)
    value_sum (B, G, L, m, dv)  sum_t f_t v_t                 -> value slots SV = value_sum / mass
    mass      (B, G, L, m)      sum_t f_t
    relation_sum (B, G, L-1, m, m)  sum_t f_t^(i) f_t^(i+1)^T -> R = relation_sum / mass^(i)
    key_ref, value_ref (B, G, L, m, d|dv)   SK, SV at the last chunk boundary (assignments and residuals use them)
    count     (B,)              real tokens written; the references refresh whenever it reaches a multiple of C

Writing token t at level i: f = softmax(beta * tau * x_k . key_ref^T) (or sigmoid), zero for padding; the next
level gets x_k <- MLP_K(x_k - p @ key_ref), x_v <- MLP_V(x_v - p @ value_ref) with p = f (softmax) or the softmax
of the same scores (sigmoid). Reading with query q (per query head) against the inclusive state:
    act_i = sigmoid(tau q.SK_i) | softmax(tau q.SK_i [+ log mass_0 at level 0])      (readout "sigmoid" | "softmax_count")
    atil_i = w_a relu(act_i @ W_i - theta_i) + theta_i / m
    chain_i = atil_0 (i = 0) | (chain_{i-1} @ R_{i-1}) * atil_i (relation) | chain_{i-1} * atil_i | atil_i (none)
    a_i = chain_i @ W_r_i;   o = sum_i a_i @ SV_i / max(sum_i sum(|a_i|), eps)   [+ sum_i (q @ W_qr_i / 16) @ SV_i]

With ``params.log_weight`` each read also returns, as one more output channel, the log of the memory's total read
weight log sum_j mass_j exp(tau q.SK_j) over the level-0 slots: the softmax mass its tokens would have had, as
cluster attention estimates it, which the local window (hf_mixers/core/window.py) weighs the memory's output by.

The normaliser is the total *absolute* read weight (W and W_r are unconstrained, so a can turn
negative). With the signed sum it can pass through zero while the numerator does not, and the output explodes:
seen in a 200-step SmolLM2 distillation (a stage-1 relative MSE of 1.5e6 at one step, stage 2 diverging). With
|a| the output is bounded by the largest value slot; while a >= 0 (at init) the two are identical.

Optional decay (GLA-style, ``log_decay`` (B, G, T) <= 0): before token t writes, the data sums (key/value sums,
mass, relations) are multiplied by exp(log_decay_t); the prototype prior never decays, padding never decays.

Because the state is sums, the token recurrence (``rsa_recurrent``, also the decode step) and the chunk form
(``rsa_chunked``) compute the same function: assignments inside a chunk use the references, everything else is a
causal cumulative sum. Chunk boundaries count each row's real tokens, so a padded row equals the sequence alone.
The chunk form writes (``write_chunks``: each level's assignment chain is the only sequential part, since
assignments need the references of the previous boundary; the rest runs over all chunks at once) and then reads the
chunks a group at a time (``read_chunks``, chunks as a batch dimension), so its op count grows with T only by the
chains' loops and the groups. Everything runs in fp32 (fp64 stays fp64).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils.checkpoint import checkpoint

from .conventions import compute_dtype, dot_precision, outside_autocast
from .dispatch import use_triton
from .rsa_state import (ChunkLayout, ChunkWrites, ResidualMLPWeights, RSAParams, RSAState, assign, decay_masks,
                        decayed, initial_state, per_head, readout_activation, refresh_references, slot_prior,
                        write_chunk, write_chunks)

# the op's public names (the state and parameter types live in rsa_state.py, shared with the Triton read)
__all__ = ["ResidualMLPWeights", "RSAParams", "RSAState", "initial_state", "rsa_step", "rsa_recurrent", "rsa_chunked",
           "rsa_memory"]


# Elements of the read side's largest intermediate, (B, G, g, C, max(C, m, d)) per chunk, that one call of
# ``read_chunks`` makes: chunks are read a group at a time so that its tensors stay a few MB. Reading all chunks at
# once made them grow with T: past glibc's mmap threshold every one of them was mapped and faulted in afresh, and
# read_chunks' time grew faster than T.
READ_GROUP_ELEMENTS = 1 << 20


def rsa_step(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """One token: q (B, G, g, d), k (B, G, d), v (B, G, dv), valid (B,) bool, log_decay (B, G) or None
    -> o (B, G, g, dv), new state."""
    groups, levels, slots, key_dim = params.prototypes.shape
    tau = key_dim**-0.5
    eps = params.eps
    prior, kappa = slot_prior(params, k.dtype)  # (1, G, L, m, d), (1, G, L, 1)
    write = valid.to(k.dtype)[:, None, None]
    if log_decay is not None:  # decay the data sums before this token writes (never on padding)
        state = decayed(state, torch.exp(log_decay.to(k.dtype) * write[..., 0]))
    x_k, x_v = k, v
    key_sum, value_sum, mass, assignments = [], [], [], []
    for i in range(levels):
        key_ref, value_ref = state.key_ref[:, :, i], state.value_ref[:, :, i]
        f, p = assign(x_k[:, :, None], key_ref, params.beta[None, :, i, None, None].to(k.dtype), params, tau)
        f, p = f[:, :, 0] * write, p[:, :, 0]  # (B, G, m)
        assignments.append(f)
        mass.append(state.mass[:, :, i] + f)
        key_sum.append(state.key_sum[:, :, i] + f[..., None] * x_k[:, :, None])
        value_sum.append(state.value_sum[:, :, i] + f[..., None] * x_v[:, :, None])
        if i < levels - 1:
            x_k = params.key_mlps[i](x_k - torch.einsum("bgm,bgmd->bgd", p, key_ref))
            x_v = params.value_mlps[i](x_v - torch.einsum("bgm,bgmd->bgd", p, value_ref))
    relation = [state.relation_sum[:, :, i] + assignments[i][..., :, None] * assignments[i + 1][..., None, :]
                for i in range(levels - 1)]
    state = RSAState(key_sum=torch.stack(key_sum, 2), value_sum=torch.stack(value_sum, 2), mass=torch.stack(mass, 2),
                     relation_sum=torch.stack(relation, 2) if relation else state.relation_sum,
                     key_ref=state.key_ref, value_ref=state.value_ref, count=state.count + valid.long())
    if params.refresh_in_step:  # only the next token's assignments read the references: a caller may do it after
        state = refresh_references(state, params, valid & (state.count % params.chunk_size == 0))

    # Read: every level at once (slots, scores, activation, W, sparse threshold), then the chain down the levels.
    slots_k = (prior + state.key_sum) / (kappa + state.mass).clamp_min(eps)[..., None]  # (B, G, L, m, d)
    slots_v = state.value_sum / state.mass.clamp_min(eps)[..., None]  # (B, G, L, m, dv)
    x = tau * torch.einsum("bghd,bglmd->bghlm", q, slots_k)
    if params.readout == "sigmoid":
        act = torch.sigmoid(x)
    else:  # count prior on level 0 only
        prior = torch.zeros_like(x[:1, :, :1])
        prior[..., 0, :] = 1.0
        act = torch.softmax(x + prior * torch.log(state.mass.clamp_min(eps))[:, :, None], dim=-1)
    threshold = per_head(params.theta(), groups)[None, ..., None]  # (1, G, g, L, 1)
    sparse = per_head(params.read_scale, groups)[None, ..., None] * torch.relu(
        torch.einsum("bghlm,ghlmn->bghln", act, per_head(params.read_proj, groups)) - threshold) + threshold / slots
    chains = [sparse[:, :, :, 0]]
    for i in range(1, levels):
        if params.routing == "relation":
            relation_i = state.relation_sum[:, :, i - 1] / state.mass[:, :, i - 1].clamp_min(eps)[..., None]
            chains.append(torch.einsum("bghm,bgmn->bghn", chains[-1], relation_i) * sparse[:, :, :, i])
        elif params.routing == "elementwise":
            chains.append(chains[-1] * sparse[:, :, :, i])
        else:
            chains.append(sparse[:, :, :, i])
    a = torch.einsum("bghlm,ghlmn->bghln", torch.stack(chains, 3), per_head(params.mix_proj, groups))
    out = torch.einsum("bghlm,bglmd->bghd", a, slots_v) / a.abs().sum((-1, -2)).clamp_min(eps)[..., None]
    if params.query_read is not None:
        weights = torch.einsum("bghd,ghldm->bghlm", q, per_head(params.query_read, groups)) / 16
        out = out + torch.einsum("bghlm,bglmd->bghd", weights, slots_v)
    if params.log_weight:
        log_weight = torch.logsumexp(x[:, :, :, 0] + torch.log(state.mass[:, :, 0].clamp_min(eps))[:, :, None], -1)
        out = torch.cat([out, log_weight[..., None]], dim=-1)
    return out, state


def rsa_recurrent(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None):
    """Reference: the token recurrence over T steps. q (B, G, g, T, d), k (B, G, T, d), v (B, G, T, dv),
    log_decay (B, G, T) or None."""
    if valid is None:
        valid = torch.ones(q.shape[0], q.shape[3], dtype=torch.bool, device=q.device)
    outputs = []
    for t in range(q.shape[3]):
        out, state = rsa_step(q[:, :, :, t], k[:, :, t], v[:, :, t], valid[:, t], state, params,
                              None if log_decay is None else log_decay[:, :, t])
        outputs.append(out * valid[:, t, None, None, None])
    return torch.stack(outputs, 3), state


def shared(rows, matrix):
    """rows (B, G, N, g, R, k) @ matrix (B, G, N, 1, k, n): one matrix per KV head and chunk, shared by its g query
    heads, whose rows are stacked into one product instead of the matrix being copied g times."""
    batch, groups, chunks, per_group, height, inner = rows.shape
    out = rows.reshape(batch, groups, chunks, per_group * height, inner) @ matrix.squeeze(3)
    return out.view(batch, groups, chunks, per_group, height, -1)


def read_chunks(q_b, writes: ChunkWrites, params: RSAParams, valid_b, decay_b=None):
    """The read side of every chunk at once (steps 3-6 of a chunk): row t of a chunk reads its inclusive state, the
    chunk-start sums plus the causal sums of its chunk's writes up to t. q_b (B, G, g, Tp, d) -> (B, G, g, Tp, dv).

    Chunks are a batch dimension here: all tensors below are (B, G, N, g | 1, C, ...), so the op count does not grow
    with the sequence length.
    """
    groups, levels, slots, key_dim = params.prototypes.shape
    tau, eps, size = key_dim**-0.5, params.eps, params.chunk_size
    count = q_b.shape[3] // size
    q = q_b.unflatten(3, (count, size)).transpose(2, 3).contiguous()  # (B, G, N, g, C, d)
    f, x, y = (t.unflatten(3, (count, size)).transpose(2, 3)[:, :, :, :, None] for t in (writes.f, writes.x, writes.y))
    f, x, y = f.unbind(3), x.unbind(3), y.unbind(3)  # per level: (B, G, N, 1, C, m | d | dv)
    write = valid_b.to(q.dtype).unflatten(1, (count, size))[:, None]  # (B, 1, N, C)
    carry, start = decay_masks(None if decay_b is None else decay_b.unflatten(2, (count, size)), write, size,
                                q.device, q.dtype)
    if decay_b is None:  # every row sees all of the chunk-start sums: no factor to apply
        start = None
    else:  # (B, G, N, C, C), (B, G, N, C) -> broadcast over the query heads; (.., C, 1): each row's share of the
        carry, start = carry[:, :, :, None], start[:, :, :, None, :, None]  # chunk-start sums
    prior, kappa = slot_prior(params, q.dtype)  # (1, G, L, m, d), (1, G, L, 1)
    at_start = lambda t, i: t[:, :, :, i, None]  # noqa: E731  (B, G, N, L, ...) -> level i, (B, G, N, 1, ...)
    seen = lambda t: t if start is None else start * t  # noqa: E731  the chunk-start part each row sees

    # The masses and the value reads are sums over every write so far that the read divides or that cancel in its
    # normalised output: their products need fp32-accurate operands, where tf32 ones suffice for the scores, the
    # slot mixing and the routing (`hf-mixers bench precision --scope read_chunks --keep inclusive_mass --keep
    # read_values`; the kernels take their dots' precision the same way, kernels/rsa_chunk_triton.py).
    def inclusive_mass(level):
        """(B, G, N, 1, C, m) per KV head: each row's inclusive mass, the chunk-start mass + the chunk's writes."""
        return seen(at_start(writes.mass, level)[..., None, :]) + carry @ f[level]

    running_mass = [inclusive_mass(i) for i in range(levels)]
    inverse_mass = [1.0 / mass.clamp_min(eps) for mass in running_mass]

    def causal_read(weights, level, sums, of):
        """weights (B, G, N, g, C, m) @ (chunk-start sums + causal sums of the chunk's writes ``of``) / mass."""
        scaled = weights * inverse_mass[level]
        intra = shared(scaled, f[level].transpose(-1, -2)) * carry
        return shared(seen(scaled), at_start(sums, level)).add_(shared(intra, of))

    def read_values(weights, level):
        return causal_read(weights, level, writes.value_sum, y[level])

    at_level = (lambda t, i: per_head(t, groups)[None, :, None, :, i])  # noqa: E731  (H, L, ..) -> (1, G, 1, g, ..)
    theta = params.theta()
    numerator, denominator, chain, log_weight = 0.0, 0.0, None, None
    for i in range(levels):
        q_dot_k = shared(q, x[i].transpose(-1, -2)) * carry  # (B, G, N, g, C, C)
        if start is None:  # q . (kappa P + the chunk-start key sums) in one product
            scores = shared(q, (prior[:, :, None, i, None] + at_start(writes.key_sum, i)).transpose(-1, -2))
        else:
            scores = (q.flatten(2, 4) @ prior[:, :, i].transpose(-1, -2)).view(q.shape[:-1] + (slots,))
            scores.add_(start * shared(q, at_start(writes.key_sum, i).transpose(-1, -2)))
        scores = scores.add_(shared(q_dot_k, f[i])).mul_(tau / (kappa[:, :, i, :, None, None, None]
                                                                + running_mass[i]).clamp_min(eps))
        act = readout_activation(scores, i, running_mass[i], params)
        if i == 0 and params.log_weight:
            log_weight = torch.logsumexp(scores + torch.log(running_mass[0].clamp_min(eps)), -1)
        threshold = at_level(theta, i)[..., None, None]
        sparse = at_level(params.read_scale, i)[..., None, None] * torch.relu(
            act @ at_level(params.read_proj, i) - threshold) + threshold / slots
        if i == 0 or params.routing == "none":
            chain = sparse
        elif params.routing == "relation":  # chain @ R_t, R_t the inclusive relation matrix of each row
            chain = causal_read(chain, i - 1, writes.relation_sum, f[i]) * sparse
        else:
            chain = chain * sparse
        a = chain @ at_level(params.mix_proj, i)
        numerator = numerator + read_values(a, i)
        denominator = denominator + a.abs().sum(-1)  # total absolute weight: bounded output (module docstring)
    out = numerator / denominator.clamp_min(eps)[..., None]
    if params.query_read is not None:
        for i in range(levels):
            out = out + read_values(q @ at_level(params.query_read, i) / 16, i)
    if log_weight is not None:
        out = torch.cat([out, log_weight[..., None]], dim=-1)
    return out.transpose(2, 3).flatten(3, 4)  # (B, G, g, Tp, dv), or dv + 1 with the log weight


def read_in_groups(q_b, writes: ChunkWrites, params: RSAParams, valid_b, decay_b=None):
    """``read_chunks`` a group of chunks at a time (``READ_GROUP_ELEMENTS``): the same values, since each chunk's
    read needs only its own writes and its start sums, from tensors of a few MB whatever the length."""
    batch, groups, group_size, padded, key_dim = q_b.shape
    size = params.chunk_size
    widest = max(size, params.prototypes.shape[2], key_dim, writes.y.shape[-1])
    rows = size * max(1, READ_GROUP_ELEMENTS // (batch * groups * group_size * size * widest))
    if rows >= padded:
        return read_chunks(q_b, writes, params, valid_b, decay_b)
    return torch.cat([read_chunks(q_b[:, :, :, start:start + rows], writes.rows(start, start + rows, size), params,
                                  valid_b[:, start:start + rows],
                                  None if decay_b is None else decay_b[:, :, start:start + rows])
                      for start in range(0, padded, rows)], 3)


def _chunk_step(q_c, k_c, v_c, valid_c, state: RSAState, params: RSAParams, decay_c=None):
    """Write and read one chunk (the recompute unit): -> out (B, G, g, C, dv), the state after its writes."""
    f, x, y, written = write_chunk(k_c, v_c, valid_c, state, params, decay_c)
    at_start = (t[:, :, None] for t in (state.key_sum, state.value_sum, state.mass, state.relation_sum))
    return read_chunks(q_c, ChunkWrites(f, x, y, *at_start), params, valid_c, decay_c), written


def rsa_chunked(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None, fresh: bool = False):
    """Chunk form, equal to ``rsa_recurrent``. Shapes as there; valid (B, T) bool or None. ``fresh``: ``state`` is
    ``initial_state``'s (every count 0), so the buffer is laid out without reading the device (``ChunkLayout``).

    Each row's real tokens are packed into an aligned buffer at offset ``count % C`` (its phase), so every row's
    chunk boundaries fall on multiples of C in the buffer whatever its padding or cached length; outputs are
    scattered back (padded positions get 0). The write side runs chunk by chunk, then the read side of the chunks
    a group at a time (``read_in_groups``); with ``params.recompute``, each chunk is written and read in turn and
    recomputed in the backward pass.
    """
    batch, groups, group_size, length, key_dim = q.shape
    size = params.chunk_size
    layout = ChunkLayout.of(valid, state.count, size, length, fresh)
    if not layout.padded:
        return q.new_zeros(batch, groups, group_size, length, v.shape[-1] + params.log_weight), state  # no real token
    q_b, k_b, v_b = layout.pack(q, 3), layout.pack(k, 2), layout.pack(v, 2)
    decay_b = None if log_decay is None else layout.pack(log_decay[..., None], 2)[..., 0]  # (B, G, T_buffer)
    valid_b = layout.valid(batch, q.device)
    if params.recompute and torch.is_grad_enabled():  # memory O(T * state) instead of every chunk's intermediates
        parts = []
        for start in range(0, layout.padded, size):  # one chunk at a time, each recomputed in the backward pass
            rows = slice(start, start + size)
            out_c, state = checkpoint(_chunk_step, q_b[:, :, :, rows], k_b[:, :, rows], v_b[:, :, rows],
                                      valid_b[:, rows], state, params, None if decay_b is None else decay_b[:, :, rows],
                                      use_reentrant=False)
            parts.append(out_c)
            state = refresh_references(state, params, layout.phase + layout.real >= start + size, skip_if_none=False)
        out_b, state = torch.cat(parts, 3), replace(state, count=state.count + layout.real)
    else:  # write chunk by chunk, then read the chunks a group at a time
        writes, state = write_chunks(k_b, v_b, valid_b, layout, state, params, decay_b)
        out_b = read_in_groups(q_b, writes, params, valid_b, decay_b)
    return layout.unpack(out_b, length), state


@outside_autocast
def rsa_memory(q, k, v, valid, state: RSAState, params: RSAParams, method: str = "chunked", log_decay=None,
               backend: str = "auto", fresh: bool = False):
    """The op's entry point: every choice of path is made here. q (B, G, g, T, d), k (B, G, T, d), v (B, G, T, dv),
    valid (B, T) bool or None, log_decay (B, G, T) or None -> o (B, G, g, T, dv [+ 1 with params.log_weight]) in
    fp32 (fp64 stays fp64) and the new state.

    method: "chunked" (training and prefill) or "recurrent" (the token recurrence, the reference). A single token
    always takes the token step. "chunked" runs its read side in Triton kernels (kernels/rsa_chunk_triton.py)
    where kernels/dispatch.py allows it for ``backend`` ("auto" | "triton" | "torch", e.g. ``config.kernel_backend``)
    and the kernel covers the call (``rsa_chunk_triton_supports``: no decay, fp32 / fp16 / bf16, tiles up to 64, ...).
    ``fresh``: ``state`` is ``initial_state``'s (the chunk forms then read nothing back from the device). The
    kernels' write takes tf32 dots for bf16 / fp16 inputs (``conventions.dot_precision``), though it computes in fp32.
    """
    if method not in ("chunked", "recurrent"):
        raise ValueError(f"rsa_memory: unknown method {method!r}; choose 'chunked' or 'recurrent'")
    precision = dot_precision(q.dtype)  # of the inputs as they came, before the cast below
    cd = compute_dtype(q.dtype)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if method == "recurrent" or q.shape[3] == 1:
        return rsa_recurrent(q, k, v, valid, state, params, log_decay)
    if use_triton("RSA chunk step", q.device, backend, check=lambda: _triton_unsupported(params, q, v, log_decay)):
        from .rsa_chunk_triton import rsa_chunked_triton  # needs triton: imported only when chosen

        return rsa_chunked_triton(q, k, v, valid, state, params, log_decay, fresh, precision)
    return rsa_chunked(q, k, v, valid, state, params, log_decay, fresh)


def _triton_unsupported(params: RSAParams, q, v, log_decay) -> str | None:
    """Why the Triton chunk read cannot take this call (None: it can); imports the kernel module, so triton."""
    from .rsa_chunk_triton import rsa_chunk_triton_supports

    return rsa_chunk_triton_supports(params, q, v, log_decay)
