"""The RSA write side as two Triton kernels a level, forward and backward: its one recurrence (the key-assignment
chain), then the rest of its write.

The chain: the same function as ``rsa_state.assign_chain`` (which holds the math and is the CPU path). For one
level, per (batch row, KV head), the chunks in order: chunk c assigns its rows against the references of its start,

    ref_c = key_ref (c = 0, or c past the row's last boundary: kept)  |  (kappa P + S_c) / max(kappa + n_c, eps)
    s     = tau X_c ref_c^T (C, m);   f = softmax(beta s) | sigmoid(beta s),   p = f | softmax(s)   (assign_fn)
    S_{c+1} = S_c + (f . valid)^T X_c,   n_{c+1} = n_c + sum_t f . valid

One program walks every chunk of one (row, head). The sums S_c it writes at every boundary are its working memory:
a chunk reads S_c (and the references' boundary) and writes S_{c+1}, FEATURE_BLOCK key features at a time,
so no (m, d) tile is carried in registers from chunk to chunk (carried, the sums, references and prototypes spilled
at SmolLM2's heads on sm_90).

The level kernels (``level_writes_triton``, the twin of ``rsa_state.level_writes``): once the chain's assignments
are known the rest is linear in them: what the level writes W = f . valid, the value sums V_{c+1} = V_c + W^T Y_c
and relation sums R_{c+1} = R_c + F_above^T W at every boundary, the next level's residual inputs X_c - p ref_k and
Y_c - p ref_v against the references of each chunk's start, and the references the state keeps. Forward, in
parallel over chunks and column blocks: every chunk's increments W^T Y_c and F_above^T W (``_level_sums_fwd``), a
running sum over the boundaries (one ``cumsum_`` each of V and R), then every chunk's residuals and the state's
references (``_level_residuals_fwd``). Backward, in parallel too: each boundary and column block routes the gradient
of the references read there to S, V and the divisor's parts (``_level_boundaries_bwd``; the chunks past a row's last
boundary all read its references, a short sum in that boundary's programs), a running sum over the reversed
boundaries gives the adjoints of V and R, then every chunk's row blocks take their gradients from the adjoints after
them, and reduce n's and kappa's (``_level_rows_bwd``). The residual MLPs are kernels/rsa_mlp_triton.py's.

The chain's backward (reverse over chunks, the same grid): the adjoints of S (in the gradient buffer of the starting
sums, feature block by block) and n carried from chunk to chunk; per chunk the assignment recomputed from the saved
sums, the softmax / sigmoid backward, and the reference's gradient handed to S_c, n_c, kappa P and kappa (or to
key_ref at c = 0). Chunks past a row's last boundary hold only padding, which nothing downstream differentiates (the
writes mask it out, the read multiplies it by F = 0): the backward skips them, their x gradient 0. Each program
writes its own partial gradients of the shared parameters (kappa P, kappa, beta: summed over rows afterwards), so
nothing is accumulated with atomics and the sums are deterministic.

Scope: ``scope_reason``, shared with the read (no decay; chunk size and slots up to MAX_TILE, head dims up to
MAX_HEAD_DIM); fp32 tensors (the memory's compute dtype), the dots' operands tf32 for a bf16 / fp16 call
(``precision``). Used with and without autograd: training, prefill, evaluation.
Both kernels run inside torch.library ops, forward and backward (torch.compile keeps each as one call); the
buffers a backward accumulates into are zero-filled as one (``common.packed_zeros``).
"""

from __future__ import annotations

import math

import torch

# A try block on purpose (see rsa_chunk_triton.py): imported only once a Triton path was chosen.
try:
    import triton
    import triton.language as tl
finally:
    pass

from .conventions import FP32_DOTS, MAX_REGISTERS, kernel_op, tile_edge, unpacked
from .rsa_state import RSAParams

# The dots' operand precision is the caller's (``precision``: conventions.dot_precision of the mixer's inputs, the
# write being fp32 here whatever they were): tf32 for a bf16 / fp16 call, fp32-accurate otherwise.
LEVEL_WARPS = 4  # the level kernels', forward and backward
CHAIN_WARPS = 4
CHAIN_STAGES = 1  # no software pipelining of the feature loops: its buffers took registers
# Every kernel's tiles: a chunk's rows 16 at a time ((16, m) scores, assignments and their gradients), features 16 at
# a time ((m, 16) references and sums, (16, 16) keys and values). At 32 rows or 32 features the chain's forward took
# 203 registers and the backwards spilled (issue 67's budget: 168 at 4 warps, no spill; docs/benchmarks.md).
ROW_BLOCK = 16
FEATURE_BLOCK = 16
MAX_TILE = 64  # chunk size and slots: one tile (C x m, m x m)
MAX_HEAD_DIM = 128  # key / value head dims (Llama-3-8B's heads): (C, d) tiles whole


def scope_reason(params: RSAParams, v=None, log_decay=None) -> str | None:
    """Why the RSA Triton kernels (this chain, the chunk read) cannot take this call as far as their shared scope
    goes -- decay, the assignment function, tile sizes -- or None."""
    if log_decay is not None:
        return "GLA-style decay (log_decay / rsa_decay=True) is not implemented in the Triton RSA kernels"
    if params.assign_fn not in ("softmax", "sigmoid"):
        return f"unknown assign_fn {params.assign_fn!r}"
    _, _, slots, key_dim = params.prototypes.shape
    sizes = [("chunk_size", params.chunk_size, MAX_TILE), ("slots", slots, MAX_TILE),
             ("key head dim", key_dim, MAX_HEAD_DIM)]
    sizes += [("value head dim", v.shape[-1], MAX_HEAD_DIM)] if v is not None else []
    for name, size, limit in sizes:
        if size > limit:
            return (f"{name} {size} > {limit}: one program holds whole tiles of it, and wider ones need more shared "
                    f"memory than a GPU block has")
    return None


@triton.jit
def _softmax_rows(x, ok):
    x = tl.where(ok, x, float("-inf"))
    e = tl.exp(x - tl.max(x, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def _assign(s, beta, slot_ok, SIGMOID: tl.constexpr):
    """The assignment f and residual weights p of one chunk from its scores s = tau x ref^T (C, M)."""
    if SIGMOID:
        f = tl.where(slot_ok[None, :], tl.sigmoid(beta * s), 0.0)
        p = _softmax_rows(s, slot_ok[None, :])
    else:
        f = _softmax_rows(beta * s, slot_ok[None, :])
        p = f
    return f, p


@triton.jit
def _reference(ref0, prior, s_ptr, at, inverse, off, ok, MD, WITH_PRIOR: tl.constexpr = True):
    """One feature block (M, BLOCK_D) of the references a chunk assigns against: the state's own at boundary 0,
    else the slots (kappa P + S_at) * inverse of boundary ``at`` (``inverse`` = 1 / max(kappa + n_at, eps));
    without WITH_PRIOR the value slots V_at * inverse (``inverse`` = 1 / max(n_at, eps))."""
    if at == 0:
        ref = tl.load(ref0 + off, mask=ok, other=0.0)
    else:
        ref = tl.load(s_ptr + at * MD + off, mask=ok, other=0.0)
        if WITH_PRIOR:
            ref += tl.load(prior + off, mask=ok, other=0.0)
        ref = ref * inverse[:, None]
    return ref


@triton.jit
def _add_into(ptr, value, ok):
    tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + value, mask=ok)


@triton.jit
def _program(boundary_ptr, ref0_ptr, prior_ptr, kappa_ptr, ref_b, ref_g, prior_g, kappa_g, G, NC):
    """This program's (batch row b, KV head g), its flat index, the row's last boundary (the last column of the
    (B, NC + 1) ``rsa_state.boundary_index``), kappa, and where its starting key references and kappa P are, read
    by their strides (views of the state and prototypes). Shared by the chain and the level kernels."""
    pid = tl.program_id(0)  # b * G + g
    b, g = pid // G, pid % G
    row, g64 = b.to(tl.int64), g.to(tl.int64)
    kappa, reached = tl.load(kappa_ptr + g * kappa_g), tl.load(boundary_ptr + row * (NC + 1) + NC).to(tl.int32)
    return (b, g, pid.to(tl.int64), row, g64, kappa, reached, ref0_ptr + row * ref_b + g64 * ref_g,
            prior_ptr + g64 * prior_g)


@triton.jit
def _scores(x_ptr, ref0, prior, sums, g_sum, token, row_ok, slots, slot_ok, at, inverse, D, MD,
            BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WITH_ADJOINT: tl.constexpr,
            PRECISION: tl.constexpr):
    """x ref_at^T of one row block (BLOCK_R, M), summed over feature blocks, and with WITH_ADJOINT also
    x g^T for the adjoint g of the sums (the backward)."""
    s = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    x_g = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok_md, ok_rd = slot_ok[:, None] & (cols < D)[None, :], row_ok[:, None] & (cols < D)[None, :]
        off_md = slots[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + token[:, None] * D + cols[None, :], mask=ok_rd, other=0.0)
        ref = _reference(ref0, prior, sums, at, inverse, off_md, ok_md, MD)
        s += tl.dot(x, tl.trans(ref), input_precision=PRECISION)
        if WITH_ADJOINT:
            x_g += tl.dot(x, tl.trans(tl.load(g_sum + off_md, mask=ok_md, other=0.0)), input_precision=PRECISION)
    return s, x_g


# The strides vary with where a state comes from (a fresh state's expanded prototypes, a cache's slices): not
# specialised on, so that one compiled kernel serves every such layout.
@triton.jit(do_not_specialize=["Tp", "NC", "ks_b", "ks_g", "m_b", "m_g", "ref_b", "ref_g", "prior_g", "kappa_g",
                               "beta_g"])
def _chain_fwd(x_ptr, valid_ptr, boundary_ptr, ks0_ptr, m0_ptr, ref0_ptr, prior_ptr, kappa_ptr, beta_ptr,
               f_ptr, p_ptr, s_ptr, n_ptr, ks_b, ks_g, m_b, m_g, ref_b, ref_g, prior_g, kappa_g, beta_g,
               Tp, NC, G, C, M, D, tau, eps,
               SIGMOID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               PRECISION: tl.constexpr):
    """One program = one (batch row, KV head). x (B, G, Tp, D); f, p (B, G, Tp, M); S (B, G, NC + 1, M, D),
    n (B, G, NC + 1, M) written at every boundary. A chunk's rows go BLOCK_R at a time (the assignments), then its
    writes S_{c+1} = S_c + sum over row blocks of F^T X, BLOCK_D features at a time."""
    b, g, head, row, g64, kappa, reached, ref0, prior = _program(boundary_ptr, ref0_ptr, prior_ptr, kappa_ptr, ref_b,
                                                                 ref_g, prior_g, kappa_g, G, NC)
    beta = tl.load(beta_ptr + g * beta_g)
    slots = tl.arange(0, BLOCK_M)
    slot_ok = slots < M
    MD = M * D
    sums = s_ptr + head * (NC + 1) * MD  # this program's S_0 ... S_NC
    masses = n_ptr + head * (NC + 1) * M
    mass = tl.load(m0_ptr + row * m_b + g64 * m_g + slots, mask=slot_ok, other=0.0)
    tl.store(masses + slots, mass, mask=slot_ok)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok_md = slot_ok[:, None] & (cols < D)[None, :]
        off_md = slots[:, None] * D + cols[None, :]
        tl.store(sums + off_md, tl.load(ks0_ptr + row * ks_b + g64 * ks_g + off_md, mask=ok_md, other=0.0),
                 mask=ok_md)
    tl.debug_barrier()
    for c in range(NC):
        at = tl.minimum(c, reached)  # the boundary whose slots this chunk assigns against
        inverse = 1.0 / tl.maximum(kappa + tl.load(masses + at * M + slots, mask=slot_ok, other=0.0), eps)
        for r0 in range(0, C, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < C
            ok_rm = row_ok[:, None] & slot_ok[None, :]
            token = head * Tp + c * C + rows
            s, _ = _scores(x_ptr, ref0, prior, sums, sums, token, row_ok, slots, slot_ok, at, inverse, D, MD, BLOCK_R,
                           BLOCK_M, BLOCK_D, False, PRECISION)
            f, p = _assign(s * tau, beta, slot_ok, SIGMOID)
            tl.store(f_ptr + token[:, None] * M + slots[None, :], f, mask=ok_rm)
            if SIGMOID:
                tl.store(p_ptr + token[:, None] * M + slots[None, :], p, mask=ok_rm)
            write = tl.load(valid_ptr + b.to(tl.int64) * Tp + c * C + rows, mask=row_ok, other=0.0)
            mass += tl.sum(f * write[:, None], 0)
        tl.store(masses + (c + 1) * M + slots, mass, mask=slot_ok)
        tl.debug_barrier()  # the chunk's f written before its rows are read back for the sums
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok_md = slot_ok[:, None] & (cols < D)[None, :]
            off_md = slots[:, None] * D + cols[None, :]
            key_sum = tl.load(sums + c * MD + off_md, mask=ok_md, other=0.0)
            for r0 in range(0, C, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                row_ok = rows < C
                token = head * Tp + c * C + rows
                write = tl.load(valid_ptr + b.to(tl.int64) * Tp + c * C + rows, mask=row_ok, other=0.0)
                written = tl.load(f_ptr + token[:, None] * M + slots[None, :],
                                  mask=row_ok[:, None] & slot_ok[None, :], other=0.0) * write[:, None]
                x = tl.load(x_ptr + token[:, None] * D + cols[None, :], mask=row_ok[:, None] & (cols < D)[None, :],
                            other=0.0)
                key_sum += tl.dot(tl.trans(written), x, input_precision=PRECISION)
            tl.store(sums + (c + 1) * MD + off_md, key_sum, mask=ok_md)
        tl.debug_barrier()  # S_{c+1}, n_{c+1} written before the next chunk reads them


@triton.jit(do_not_specialize=["Tp", "NC", "ref_b", "ref_g", "prior_g", "kappa_g", "beta_g", "partials_b"])
def _chain_bwd(x_ptr, valid_ptr, boundary_ptr, ref0_ptr, prior_ptr, kappa_ptr, beta_ptr, s_ptr, n_ptr,
               df_ptr, dp_ptr, ds_ptr, dn_ptr, w_ptr, dz_ptr,
               dx_ptr, dks0_ptr, dm0_ptr, dref0_ptr, dprior_ptr, dkappa_ptr, dbeta_ptr,
               ref_b, ref_g, prior_g, kappa_g, beta_g, partials_b, Tp, NC, G, C, M, D, tau, eps,
               SIGMOID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
               PRECISION: tl.constexpr):
    """One program = one (batch row, KV head), chunks in reverse. d* are the gradients of the forward's outputs
    (dp only with SIGMOID); writes all of its dx (B, G, Tp, D) (zeros past the row's last boundary), the gradients
    of the starting state, and this program's partials of kappa P (G, M, D), kappa and beta (G,) in its batch row of
    one partials buffer (``partials_b`` apart), so one sum over the rows reduces all three. Every output is written
    whole here: none needs a zero fill. The adjoint of the key sums lives in dks0 (its final value), BLOCK_D
    features at a time, as the forward's S; the partial of kappa P accumulates in dprior (zeroed here first). w, dz
    (B, G, C, M): a chunk's written assignments and score gradients, between its row pass and its feature pass."""
    b, g, head, row, g64, kappa, reached, ref0, prior = _program(boundary_ptr, ref0_ptr, prior_ptr, kappa_ptr, ref_b,
                                                                 ref_g, prior_g, kappa_g, G, NC)
    beta = tl.load(beta_ptr + g * beta_g)
    slots = tl.arange(0, BLOCK_M)
    slot_ok = slots < M
    MD = M * D
    sums, masses = s_ptr + head * (NC + 1) * MD, n_ptr + head * (NC + 1) * M
    d_sums, d_masses = ds_ptr + head * (NC + 1) * MD, dn_ptr + head * (NC + 1) * M
    g_sum = dks0_ptr + head * MD  # the adjoint of S_{c+1}, then of S_c
    scratch_w, scratch_dz = w_ptr + head * C * M, dz_ptr + head * C * M
    d_prior = dprior_ptr + row * partials_b + g64 * MD  # this program's partial of kappa P
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok_md = slot_ok[:, None] & (cols < D)[None, :]
        off_md = slots[:, None] * D + cols[None, :]
        tl.store(g_sum + off_md, tl.load(d_sums + NC * MD + off_md, mask=ok_md, other=0.0), mask=ok_md)
        tl.store(d_prior + off_md, tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), mask=ok_md)
    g_mass = tl.load(d_masses + NC * M + slots, mask=slot_ok, other=0.0)
    d_kappa = 0.0
    d_beta = 0.0
    tl.debug_barrier()
    for step in range(NC):
        c = NC - 1 - step
        if c <= reached:  # a chunk with real rows (past the last boundary: padding only, nothing to differentiate)
            total = kappa + tl.load(masses + c * M + slots, mask=slot_ok, other=0.0)
            inverse = 1.0 / tl.maximum(total, eps)
            for r0 in range(0, C, BLOCK_R):  # the rows: dL/ds, tau included
                rows = r0 + tl.arange(0, BLOCK_R)
                row_ok = rows < C
                ok_rm = row_ok[:, None] & slot_ok[None, :]
                token = head * Tp + c * C + rows
                write = tl.load(valid_ptr + b.to(tl.int64) * Tp + c * C + rows, mask=row_ok, other=0.0)
                s, x_g = _scores(x_ptr, ref0, prior, sums, g_sum, token, row_ok, slots, slot_ok, c, inverse, D, MD,
                                 BLOCK_R, BLOCK_M, BLOCK_D, True, PRECISION)
                s = s * tau
                f, p = _assign(s, beta, slot_ok, SIGMOID)
                # dL/df: its own gradient, plus what the sums it wrote carry back (written = f . valid)
                d_f = tl.load(df_ptr + token[:, None] * M + slots[None, :], mask=ok_rm, other=0.0)
                d_f += write[:, None] * (x_g + g_mass[None, :])
                if SIGMOID:
                    d_z = d_f * f * (1.0 - f)
                    d_p = tl.load(dp_ptr + token[:, None] * M + slots[None, :], mask=ok_rm, other=0.0)
                    d_s = beta * d_z + p * (d_p - tl.sum(d_p * p, 1)[:, None])
                else:
                    d_z = f * (d_f - tl.sum(d_f * f, 1)[:, None])
                    d_s = beta * d_z
                d_z = tl.where(ok_rm, d_z, 0.0)
                d_beta += tl.sum(tl.sum(d_z * s, 1), 0)
                off_rm = rows[:, None] * M + slots[None, :]
                tl.store(scratch_w + off_rm, f * write[:, None], mask=ok_rm)
                tl.store(scratch_dz + off_rm, tl.where(ok_rm, d_s, 0.0) * tau, mask=ok_rm)
            tl.debug_barrier()
            d_ref_ref = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over features of d ref . ref
            for d0 in range(0, D, BLOCK_D):  # the features: dx, and the references' gradient
                cols = d0 + tl.arange(0, BLOCK_D)
                ok_md = slot_ok[:, None] & (cols < D)[None, :]
                off_md = slots[:, None] * D + cols[None, :]
                ref = _reference(ref0, prior, sums, c, inverse, off_md, ok_md, MD)
                adjoint = tl.load(g_sum + off_md, mask=ok_md, other=0.0)
                d_ref = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
                for r0 in range(0, C, BLOCK_R):
                    rows = r0 + tl.arange(0, BLOCK_R)
                    row_ok = rows < C
                    ok_rm, ok_rd = row_ok[:, None] & slot_ok[None, :], row_ok[:, None] & (cols < D)[None, :]
                    token = head * Tp + c * C + rows
                    off_rm = rows[:, None] * M + slots[None, :]
                    written = tl.load(scratch_w + off_rm, mask=ok_rm, other=0.0)
                    d_s = tl.load(scratch_dz + off_rm, mask=ok_rm, other=0.0)
                    x = tl.load(x_ptr + token[:, None] * D + cols[None, :], mask=ok_rd, other=0.0)
                    d_x = tl.dot(written, adjoint, input_precision=PRECISION) + tl.dot(d_s, ref,
                                                                                        input_precision=PRECISION)
                    tl.store(dx_ptr + token[:, None] * D + cols[None, :], d_x, mask=ok_rd)
                    d_ref += tl.dot(tl.trans(d_s), x, input_precision=PRECISION)  # (M, BLOCK_D)
                if c == 0:
                    tl.store(dref0_ptr + head * MD + off_md, d_ref, mask=ok_md)
                else:  # ref = (kappa P + S_c) / (kappa + n_c)
                    scaled = d_ref * inverse[:, None]
                    tl.store(g_sum + off_md, adjoint + scaled, mask=ok_md)
                    _add_into(d_prior + off_md, scaled, ok_md)
                    d_ref_ref += tl.sum(d_ref * ref, 1)
            if c > 0:
                d_total = tl.where(total > eps, -d_ref_ref * inverse, 0.0)  # the clamp holds: no gradient
                g_mass += d_total
                d_kappa += tl.sum(d_total, 0)
        else:  # padding only: its rows' dx is zero
            for r0 in range(0, C, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                token = head * Tp + c * C + rows
                for d0 in range(0, D, BLOCK_D):
                    cols = d0 + tl.arange(0, BLOCK_D)
                    tl.store(dx_ptr + token[:, None] * D + cols[None, :], tl.zeros((BLOCK_R, BLOCK_D), tl.float32),
                             mask=(rows < C)[:, None] & (cols < D)[None, :])
        tl.debug_barrier()
        for d0 in range(0, D, BLOCK_D):  # now the adjoint of S_c
            cols = d0 + tl.arange(0, BLOCK_D)
            ok_md = slot_ok[:, None] & (cols < D)[None, :]
            off_md = slots[:, None] * D + cols[None, :]
            tl.store(g_sum + off_md, tl.load(g_sum + off_md, mask=ok_md, other=0.0)
                     + tl.load(d_sums + c * MD + off_md, mask=ok_md, other=0.0), mask=ok_md)
        g_mass += tl.load(d_masses + c * M + slots, mask=slot_ok, other=0.0)
        tl.debug_barrier()
    tl.store(dm0_ptr + head * M + slots, g_mass, mask=slot_ok)
    tl.store(dkappa_ptr + row * partials_b + g64, d_kappa)
    tl.store(dbeta_ptr + row * partials_b + g64, d_beta)


# ----------------------------------------------------------------------------------------------------------------
# The rest of a level's write (rsa_state.level_writes), once its chain is known: linear in the assignments.


@triton.jit
def _boundary_sums(f_ptr, valid_ptr, z_ptr, w_ptr, start_ptr, sums_ptr, b, head, c, NC, Tp, C, M, width, slots, slot_ok,
                   cols, store_w, TRANSPOSED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_Z: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c's increment at boundary c + 1 of sums (M, width), columns ``cols``: W_c^T Z_c, W = f . valid, Z's
    rows ``width`` wide (TRANSPOSED: Z_c^T W_c, an (M, M) sum); chunk 0 also copies the starting sums to boundary 0.
    W itself is written too where ``store_w``."""
    ok, off = slot_ok[:, None] & (cols < width)[None, :], slots[:, None] * width + cols[None, :]
    if c == 0:
        tl.store(sums_ptr + off, tl.load(start_ptr + off, mask=ok, other=0.0), mask=ok)
    if c < NC:  # (no chunks: the grid's one chunk index writes boundary 0 alone)
        total = tl.zeros((BLOCK_M, BLOCK_Z), dtype=tl.float32)
        for r0 in range(0, C, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = rows < C
            ok_rm, token = row_ok[:, None] & slot_ok[None, :], head * Tp + c * C + rows
            write = tl.load(valid_ptr + b * Tp + c * C + rows, mask=row_ok, other=0.0)
            w = tl.load(f_ptr + token[:, None] * M + slots[None, :], mask=ok_rm, other=0.0) * write[:, None]
            if store_w:
                tl.store(w_ptr + token[:, None] * M + slots[None, :], w, mask=ok_rm)
            z = tl.load(z_ptr + token[:, None] * width + cols[None, :], mask=row_ok[:, None] & (cols < width)[None, :],
                        other=0.0)
            if TRANSPOSED:
                total += tl.dot(tl.trans(z), w, input_precision=PRECISION)
            else:
                total += tl.dot(tl.trans(w), z, input_precision=PRECISION)
        tl.store(sums_ptr + (c + 1) * M * width + off, total, mask=ok)


@triton.jit(do_not_specialize=["Tp", "NC", "v0_b", "v0_g", "r0_b", "r0_g"])
def _level_sums_fwd(f_ptr, y_ptr, valid_ptr, v0_ptr, above_ptr, r0_ptr, w_ptr, v_ptr, r_ptr, v0_b, v0_g, r0_b, r0_g,
                    Tp, NC, G, C, M, DV,
                    RELATION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Grid (B * G, max(NC, 1), value-column blocks [+ 1 with RELATION]). Program (head, c, e) writes chunk c's
    increment at boundary c + 1: W_c^T y_c of V's columns e (e = 0 also writes W = f . valid), or, the last e with
    RELATION, F_above^T W_c of R; chunk 0's programs write boundary 0's starting sums too. ``_level_forward``'s
    cumulative sum over the boundaries makes them V and R. One accumulator a program: R's (m x m) tile beside V's
    spilled on sm_90."""
    head, c, e = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    b, g = head // G, head % G
    slots = tl.arange(0, BLOCK_M)
    slot_ok = slots < M
    if RELATION and e == tl.cdiv(DV, BLOCK_DV):  # R's program
        _boundary_sums(f_ptr, valid_ptr, above_ptr, w_ptr, r0_ptr + b * r0_b + g * r0_g,
                       r_ptr + head * (NC + 1) * M * M, b, head, c, NC, Tp, C, M, M, slots, slot_ok, slots, False,
                       True, BLOCK_R, BLOCK_M, BLOCK_M, PRECISION)
    else:  # V's columns e
        _boundary_sums(f_ptr, valid_ptr, y_ptr, w_ptr, v0_ptr + b * v0_b + g * v0_g,
                       v_ptr + head * (NC + 1) * M * DV, b, head, c, NC, Tp, C, M, DV, slots, slot_ok,
                       e * BLOCK_DV + tl.arange(0, BLOCK_DV), e == 0, False, BLOCK_R, BLOCK_M, BLOCK_DV, PRECISION)


@triton.jit
def _minus_assigned(p_ptr, src_ptr, out_ptr, ref, start, cols, width, C, M, slots, slot_ok, BLOCK_R: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One chunk's rows (from token ``start``) of src - p ref, for one column block of ref (M, BLOCK_F)."""
    for r0 in range(0, C, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < C
        token = start + rows
        ok_rf = row_ok[:, None] & (cols < width)[None, :]
        p = tl.load(p_ptr + token[:, None] * M + slots[None, :], mask=row_ok[:, None] & slot_ok[None, :], other=0.0)
        src = tl.load(src_ptr + token[:, None] * width + cols[None, :], mask=ok_rf, other=0.0)
        tl.store(out_ptr + token[:, None] * width + cols[None, :], src - tl.dot(p, ref, input_precision=PRECISION),
                 mask=ok_rf)


@triton.jit(do_not_specialize=["Tp", "NC", "FINAL", "kref_b", "kref_g", "vref_b", "vref_g", "prior_g", "kappa_g"])
def _level_residuals_fwd(p_ptr, x_ptr, y_ptr, boundary_ptr, s_ptr, n_ptr, v_ptr, kref0_ptr, vref0_ptr, prior_ptr,
                         kappa_ptr, xn_ptr, yn_ptr, kout_ptr, vout_ptr, kref_b, kref_g, vref_b, vref_g, prior_g,
                         kappa_g, Tp, NC, FINAL, G, C, M, D, DV, eps,
                         BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (B * G, FINAL + 1, key-column blocks then value-column blocks; FINAL = NC with a residual, else 0).
    Program (head, c, j) with c < FINAL: chunk c's rows of the next level's inputs against the references of
    boundary at = min(c, reached), x - p ref_k (a key block j) or y - p ref_v (a value block); c = FINAL: block j of
    the references the state keeps, boundary min(NC, reached). V is the finished value sums (``_level_sums_fwd``)."""
    b, g, head, row, g64, kappa, reached, kref0, prior = _program(boundary_ptr, kref0_ptr, prior_ptr, kappa_ptr, kref_b,
                                                                  kref_g, prior_g, kappa_g, G, NC)
    c, j = tl.program_id(1), tl.program_id(2)
    vref0 = vref0_ptr + row * vref_b + g64 * vref_g
    slots = tl.arange(0, BLOCK_M)
    slot_ok = slots < M
    MD, MDV = M * D, M * DV
    sums, masses, values = s_ptr + head * (NC + 1) * MD, n_ptr + head * (NC + 1) * M, v_ptr + head * (NC + 1) * MDV
    residual = c < FINAL
    at = tl.where(residual, tl.minimum(c, reached), tl.minimum(NC, reached))
    n_at = tl.load(masses + at * M + slots, mask=slot_ok, other=0.0)
    key_blocks = tl.cdiv(D, BLOCK_F)
    start = head * Tp + c * C
    if j < key_blocks:  # keys: x - p ref_k
        cols = j * BLOCK_F + tl.arange(0, BLOCK_F)
        ok, off = slot_ok[:, None] & (cols < D)[None, :], slots[:, None] * D + cols[None, :]
        ref = _reference(kref0, prior, sums, at, 1.0 / tl.maximum(kappa + n_at, eps), off, ok, MD, True)
        if residual:
            _minus_assigned(p_ptr, x_ptr, xn_ptr, ref, start, cols, D, C, M, slots, slot_ok, BLOCK_R, PRECISION)
        else:
            tl.store(kout_ptr + head * MD + off, ref, mask=ok)
    else:  # values: y - p ref_v
        cols = (j - key_blocks) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok, off = slot_ok[:, None] & (cols < DV)[None, :], slots[:, None] * DV + cols[None, :]
        ref = _reference(vref0, prior, values, at, 1.0 / tl.maximum(n_at, eps), off, ok, MDV, False)
        if residual:
            _minus_assigned(p_ptr, y_ptr, yn_ptr, ref, start, cols, DV, C, M, slots, slot_ok, BLOCK_R, PRECISION)
        else:
            tl.store(vout_ptr + head * MDV + off, ref, mask=ok)


@triton.jit
def _divisor_gradient(kappa, n_at, eps, d_key, d_value):
    """The gradients of n_at (and its kappa share) from sum d_ref . ref of the key and value references."""
    k_inverse, v_inverse = 1.0 / tl.maximum(kappa + n_at, eps), 1.0 / tl.maximum(n_at, eps)
    d_total = tl.where(kappa + n_at > eps, -d_key * k_inverse, 0.0)
    return d_total + tl.where(n_at > eps, -d_value * v_inverse, 0.0), tl.sum(d_total, 0)


@triton.jit
def _reference_gradient(p_ptr, dnext_ptr, dfinal_ptr, first, last, head, Tp, NC, C, M, width, cols, slots, slot_ok,
                        RESIDUAL: tl.constexpr, KEPT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_F: tl.constexpr, PRECISION: tl.constexpr):
    """Columns ``cols`` (M, BLOCK_F) of the gradient of the references that chunks first..last read: -p_c^T dnext_c
    summed over them (RESIDUAL), and where last = NC, dfinal, the gradient of the references the state keeps (KEPT:
    given; a training step's loss never reads them). An empty range (last < first) gives 0."""
    d_ref = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    if KEPT and last == NC:
        d_ref += tl.load(dfinal_ptr + head * M * width + slots[:, None] * width + cols[None, :],
                         mask=slot_ok[:, None] & (cols < width)[None, :], other=0.0)
    if RESIDUAL:
        for c in range(first, tl.minimum(last + 1, NC)):
            for r0 in range(0, C, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                row_ok = rows < C
                token = head * Tp + c * C + rows
                p = tl.load(p_ptr + token[:, None] * M + slots[None, :], mask=row_ok[:, None] & slot_ok[None, :],
                            other=0.0)
                d_next = tl.load(dnext_ptr + token[:, None] * width + cols[None, :],
                                 mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)
                d_ref -= tl.dot(tl.trans(p), d_next, input_precision=PRECISION)
    return d_ref


@triton.jit
def _level_program(boundary_ptr, kref0_ptr, vref0_ptr, prior_ptr, kappa_ptr, kref_b, kref_g, vref_b, vref_g, prior_g,
                   kappa_g, G, NC, M, BLOCK_M: tl.constexpr):
    """What a level backward's program starts from (``_program``, and the value references): its (row, head) index
    and batch row, kappa, the row's last boundary, its starting key and value references and kappa P, the index of
    its boundary 0, the slots and which are real."""
    _, _, head, row, g64, kappa, reached, kref0, prior = _program(boundary_ptr, kref0_ptr, prior_ptr, kappa_ptr, kref_b,
                                                                  kref_g, prior_g, kappa_g, G, NC)
    slots = tl.arange(0, BLOCK_M)
    return (head, row, kappa, reached, kref0, vref0_ptr + row * vref_b + g64 * vref_g, prior, head * (NC + 1), slots,
            slots < M)


@triton.jit(do_not_specialize=["Tp", "NC", "kref_b", "kref_g", "vref_b", "vref_g", "prior_g", "kappa_g", "gv_b", "gv_g",
                               "gv_c", "dr_b", "dr_g", "dr_c"])
def _level_boundaries_bwd(p_ptr, boundary_ptr, s_ptr, n_ptr, v_ptr, kref0_ptr, vref0_ptr, prior_ptr, kappa_ptr,
                          gv_ptr, dr_ptr, dxn_ptr, dyn_ptr, dkout_ptr, dvout_ptr,
                          ds_ptr, parts_ptr, adj_ptr, dkref0_ptr, dvref0_ptr,
                          kref_b, kref_g, vref_b, vref_g, prior_g, kappa_g, gv_b, gv_g, gv_c, dr_b, dr_g, dr_c,
                          Tp, NC, G, C, M, D, DV, eps,
                          RESIDUAL: tl.constexpr, RELATION: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          PRECISION: tl.constexpr, KEPT_GRADS: tl.constexpr):
    """The backward's first pass, grid (B * G, NC + 1, key-column blocks then value-column blocks): program
    (head, b, j) takes columns j of the references read at boundary b (chunk b's; at b = reached also those of
    every later chunk and the state's) and hands their gradient to what they are made of: the starting references at
    b = 0, else S_b and V_b, and its share of sum d_ref . ref, the divisor's (parts: n_b's and kappa's gradients,
    summed over j in ``_level_rows_bwd``). ds holds a row of M * D + 1 a boundary: S_b's gradient, then kappa's share
    (summed over rows and boundaries, the row is kappa P's and kappa's gradients). V's gradient at b, gv_b plus its
    share, then R's dR_b, make row NC - b of adj (M * DV [+ M * M] wide): a cumulative sum over its rows is then the
    adjoints of V and R at every boundary. Boundaries past ``reached`` (read by no chunk) get zeros. Without
    KEPT_GRADS the kept references' gradients (dkout, dvout) are 0 and not read. gv, dr (B, G, NC + 1, M, DV | M)
    are read by their batch, head and boundary strides (each boundary's block dense)."""
    head, row, kappa, reached, kref0, vref0, prior, bounds, slots, slot_ok = _level_program(
        boundary_ptr, kref0_ptr, vref0_ptr, prior_ptr, kappa_ptr, kref_b, kref_g, vref_b, vref_g, prior_g, kappa_g, G,
        NC, M, BLOCK_M)
    at, j = tl.program_id(1), tl.program_id(2)
    MD, MDV, MM = M * D, M * DV, M * M
    key_blocks = tl.cdiv(D, BLOCK_D)
    d_sums, adjoint = ds_ptr + (bounds + at) * (MD + 1), adj_ptr + (bounds + NC - at) * (MDV + RELATION * MM)
    n_at = tl.load(n_ptr + (bounds + at) * M + slots, mask=slot_ok, other=0.0)
    # the chunks whose references are boundary at's: at alone, or at = reached and every later one (then NC: the
    # state's); none past reached
    first, last = at, tl.where(at < reached, at, tl.where(at == reached, NC, -1))
    part = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum over columns j of d_ref . ref
    if j < key_blocks:  # the key references: S_b
        inverse = 1.0 / tl.maximum(kappa + n_at, eps)
        cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
        ok, off = slot_ok[:, None] & (cols < D)[None, :], slots[:, None] * D + cols[None, :]
        d_ref = _reference_gradient(p_ptr, dxn_ptr, dkout_ptr, first, last, head, Tp, NC, C, M, D, cols, slots,
                                    slot_ok, RESIDUAL, KEPT_GRADS, BLOCK_R, BLOCK_M, BLOCK_D, PRECISION)
        if at == 0:
            tl.store(dkref0_ptr + head * MD + off, d_ref, mask=ok)
        else:
            part = tl.sum(d_ref * _reference(kref0, prior, s_ptr + bounds * MD, at, inverse, off, ok, MD, True), 1)
        tl.store(d_sums + off, tl.where(at == 0, 0.0, d_ref * inverse[:, None]), mask=ok)
    else:  # the value references: V_b
        inverse = 1.0 / tl.maximum(n_at, eps)
        cols = (j - key_blocks) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ok, off = slot_ok[:, None] & (cols < DV)[None, :], slots[:, None] * DV + cols[None, :]
        d_ref = _reference_gradient(p_ptr, dyn_ptr, dvout_ptr, first, last, head, Tp, NC, C, M, DV, cols, slots,
                                    slot_ok, RESIDUAL, KEPT_GRADS, BLOCK_R, BLOCK_M, BLOCK_DV, PRECISION)
        g_value = tl.load(gv_ptr + row * gv_b + (head - row * G) * gv_g + at * gv_c + off, mask=ok, other=0.0)
        if at == 0:
            tl.store(dvref0_ptr + head * MDV + off, d_ref, mask=ok)
        else:
            part = tl.sum(d_ref * _reference(vref0, prior, v_ptr + bounds * MDV, at, inverse, off, ok, MDV, False), 1)
            g_value += d_ref * inverse[:, None]
        tl.store(adjoint + off, g_value, mask=ok)
        if RELATION and j == key_blocks:
            off_mm, ok_mm = slots[:, None] * M + slots[None, :], slot_ok[:, None] & slot_ok[None, :]
            d_relation = tl.load(dr_ptr + row * dr_b + (head - row * G) * dr_g + at * dr_c + off_mm, mask=ok_mm,
                                 other=0.0)
            tl.store(adjoint + MDV + off_mm, d_relation, mask=ok_mm)
    tl.store(parts_ptr + ((bounds + at) * tl.num_programs(2) + j) * M + slots, part, mask=slot_ok)


@triton.jit
def _divisor_at(n_ptr, parts_ptr, ds_ptr, dn_ptr, kappa, bounds, at, blocks, key_blocks, MD, M, eps, slots,
                slot_ok):
    """Boundary ``at``'s divisor gradients from ``_level_boundaries_bwd``'s parts (its key then value column blocks'
    sums of d_ref . ref): n_at's into dn, kappa's share into the last entry of the boundary's row of ds."""
    d_key = tl.zeros_like(slots.to(tl.float32))
    d_value = tl.zeros_like(d_key)
    for j in range(blocks):
        part = tl.load(parts_ptr + ((bounds + at) * blocks + j) * M + slots, mask=slot_ok, other=0.0)
        if j < key_blocks:
            d_key += part
        else:
            d_value += part
    n_at = tl.load(n_ptr + (bounds + at) * M + slots, mask=slot_ok, other=0.0)
    d_n, d_kappa = _divisor_gradient(kappa, n_at, eps, d_key, d_value)  # 0 at boundary 0 and past reached
    tl.store(dn_ptr + (bounds + at) * M + slots, d_n, mask=slot_ok)
    tl.store(ds_ptr + (bounds + at) * (MD + 1) + MD, d_kappa)


@triton.jit(do_not_specialize=["Tp", "NC", "kref_b", "kref_g", "vref_b", "vref_g", "prior_g", "kappa_g", "dw_b",
                               "dw_g"])
def _level_rows_bwd(f_ptr, p_ptr, y_ptr, valid_ptr, boundary_ptr, s_ptr, n_ptr, v_ptr, kref0_ptr, vref0_ptr, prior_ptr,
                    kappa_ptr, above_ptr, dw_ptr, adj_ptr, parts_ptr, dxn_ptr, dyn_ptr,
                    df_ptr, dp_ptr, dy_ptr, dabove_ptr, ds_ptr, dn_ptr,
                    kref_b, kref_g, vref_b, vref_g, prior_g, kappa_g, dw_b, dw_g, Tp, NC, G, C, M, D, DV, eps,
                    SIGMOID: tl.constexpr, RESIDUAL: tl.constexpr, RELATION: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    PRECISION: tl.constexpr):
    """The backward's second pass, grid (B * G, max(NC, 1), row blocks): program (head, c, r) takes BLOCK_R rows of
    chunk c, given the adjoints A_V, A_R of the boundary after it (adj: the first pass's, summed): dW = dW_out +
    Y A_V^T + F_above A_R, df = dW . valid (+ dp for softmax), dp = -(dxn ref_k^T + dyn ref_v^T), dy = dyn + W A_V,
    dabove = W A_R^T. Program (head, c, 0) also reduces boundary c + 1's divisor gradients (``_divisor_at``), and
    (head, 0, 0) boundary 0's. (The starting sums' gradients are the adjoints at boundary 0: adj's row NC.) dW_out
    (dw: B, G, Tp, M) is read by its batch and head strides (its rows dense)."""
    head, row, kappa, reached, kref0, vref0, prior, bounds, slots, slot_ok = _level_program(
        boundary_ptr, kref0_ptr, vref0_ptr, prior_ptr, kappa_ptr, kref_b, kref_g, vref_b, vref_g, prior_g, kappa_g, G,
        NC, M, BLOCK_M)
    c = tl.program_id(1)
    MD, MDV, MM = M * D, M * DV, M * M
    width = MDV + RELATION * MM  # of a row of adj
    if tl.program_id(2) == 0:
        blocks, key_blocks = tl.cdiv(D, BLOCK_D) + tl.cdiv(DV, BLOCK_DV), tl.cdiv(D, BLOCK_D)
        if c < NC:
            _divisor_at(n_ptr, parts_ptr, ds_ptr, dn_ptr, kappa, bounds, c + 1, blocks, key_blocks, MD, M, eps, slots,
                        slot_ok)
        if c == 0:
            _divisor_at(n_ptr, parts_ptr, ds_ptr, dn_ptr, kappa, bounds, 0, blocks, key_blocks, MD, M, eps, slots,
                        slot_ok)
    if c < NC:
        at = tl.minimum(c, reached)
        n_at = tl.load(n_ptr + (bounds + at) * M + slots, mask=slot_ok, other=0.0)
        k_inverse, v_inverse = 1.0 / tl.maximum(kappa + n_at, eps), 1.0 / tl.maximum(n_at, eps)
        after = adj_ptr + (bounds + NC - c - 1) * width  # boundary c + 1's adjoints
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < C
        ok_rm, token = row_ok[:, None] & slot_ok[None, :], head * Tp + c * C + rows
        off_rm = token[:, None] * M + slots[None, :]
        write = tl.load(valid_ptr + row * Tp + c * C + rows, mask=row_ok, other=0.0)
        # dy = dyn + W A_V, a value block at a time
        w = tl.load(f_ptr + off_rm, mask=ok_rm, other=0.0) * write[:, None]
        for e0 in range(0, DV, BLOCK_DV):
            cols = e0 + tl.arange(0, BLOCK_DV)
            ok, off = slot_ok[:, None] & (cols < DV)[None, :], slots[:, None] * DV + cols[None, :]
            ok_rv = row_ok[:, None] & (cols < DV)[None, :]
            d_y = tl.dot(w, tl.load(after + off, mask=ok, other=0.0), input_precision=PRECISION)
            if RESIDUAL:
                d_y += tl.load(dyn_ptr + token[:, None] * DV + cols[None, :], mask=ok_rv, other=0.0)
            tl.store(dy_ptr + token[:, None] * DV + cols[None, :], d_y, mask=ok_rv)
        if RELATION:  # dabove = W A_R^T, BLOCK_S slots of W at a time (no m x m tile held)
            d_above = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
            for s0 in range(0, M, BLOCK_S):
                part = s0 + tl.arange(0, BLOCK_S)
                w_part = tl.load(f_ptr + token[:, None] * M + part[None, :],
                                 mask=row_ok[:, None] & (part < M)[None, :], other=0.0) * write[:, None]
                adjoint = tl.load(after + MDV + slots[:, None] * M + part[None, :],
                                  mask=slot_ok[:, None] & (part < M)[None, :], other=0.0)  # A_R[:, part]
                d_above += tl.dot(w_part, tl.trans(adjoint), input_precision=PRECISION)
            tl.store(dabove_ptr + off_rm, d_above, mask=ok_rm)
        # df = (dW_out + Y A_V^T + F_above A_R) . valid [+ dp], dp = -(dxn ref_k^T + dyn ref_v^T): softmax sums both
        # in one accumulator (valid scales Y's and F_above's rows first)
        d_written = dw_ptr + row * dw_b + (head - row * G) * dw_g + (c * C + rows)[:, None] * M + slots[None, :]
        d_f = tl.load(d_written, mask=ok_rm, other=0.0) * write[:, None]
        if SIGMOID:
            d_p = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
        for e0 in range(0, DV, BLOCK_DV):
            cols = e0 + tl.arange(0, BLOCK_DV)
            ok, off = slot_ok[:, None] & (cols < DV)[None, :], slots[:, None] * DV + cols[None, :]
            ok_rv = row_ok[:, None] & (cols < DV)[None, :]
            y = tl.load(y_ptr + token[:, None] * DV + cols[None, :], mask=ok_rv, other=0.0) * write[:, None]
            d_f += tl.dot(y, tl.trans(tl.load(after + off, mask=ok, other=0.0)), input_precision=PRECISION)
            if RESIDUAL:
                ref = _reference(vref0, prior, v_ptr + bounds * MDV, at, v_inverse, off, ok, MDV, False)
                d_next = tl.load(dyn_ptr + token[:, None] * DV + cols[None, :], mask=ok_rv, other=0.0)
                if SIGMOID:
                    d_p -= tl.dot(d_next, tl.trans(ref), input_precision=PRECISION)
                else:
                    d_f -= tl.dot(d_next, tl.trans(ref), input_precision=PRECISION)
        if RESIDUAL:
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                ok, off = slot_ok[:, None] & (cols < D)[None, :], slots[:, None] * D + cols[None, :]
                ref = _reference(kref0, prior, s_ptr + bounds * MD, at, k_inverse, off, ok, MD, True)
                d_next = tl.load(dxn_ptr + token[:, None] * D + cols[None, :],
                                 mask=row_ok[:, None] & (cols < D)[None, :], other=0.0)
                if SIGMOID:
                    d_p -= tl.dot(d_next, tl.trans(ref), input_precision=PRECISION)
                else:
                    d_f -= tl.dot(d_next, tl.trans(ref), input_precision=PRECISION)
        if RELATION:
            for s0 in range(0, M, BLOCK_S):
                part = s0 + tl.arange(0, BLOCK_S)
                above = tl.load(above_ptr + token[:, None] * M + part[None, :],
                                mask=row_ok[:, None] & (part < M)[None, :], other=0.0) * write[:, None]
                adjoint = tl.load(after + MDV + part[:, None] * M + slots[None, :],
                                  mask=(part < M)[:, None] & slot_ok[None, :], other=0.0)  # A_R[part, :]
                d_f += tl.dot(above, adjoint, input_precision=PRECISION)
        tl.store(df_ptr + off_rm, d_f, mask=ok_rm)
        if SIGMOID and RESIDUAL:
            tl.store(dp_ptr + off_rm, d_p, mask=ok_rm)


def _launch_options(sigmoid: bool, chunk_size: int, slots: int, key_dim: int, precision: str) -> dict:
    return dict(SIGMOID=sigmoid, BLOCK_R=tile_edge(chunk_size, ROW_BLOCK), BLOCK_M=tile_edge(slots),
                BLOCK_D=tile_edge(key_dim, FEATURE_BLOCK), PRECISION=precision, num_warps=CHAIN_WARPS,
                num_stages=CHAIN_STAGES)


# The chain and level kernels as torch.library ops, forward and backward: torch.compile keeps each as one opaque call
# in its graph (it never traces a launch), so a block's training step stays one graph and can be captured as a CUDA
# graph. Optional results are left out of an op's list (ops may not return None, nor one tensor twice).
Tensor = torch.Tensor


def _chain_sizes(x, prior, chunk_size, eps):
    batch, groups, padded, key_dim = x.shape
    return (padded, padded // chunk_size, groups, chunk_size, prior.shape[1], key_dim, key_dim**-0.5, eps)


def _chain_read_strides(key_ref, prior, kappa, beta):
    return (*key_ref.stride()[:2], prior.stride(0), kappa.stride(0), beta.stride(0))


@kernel_op(__name__, "chain_forward")
def _chain_forward(x: Tensor, valid: Tensor, key_sum: Tensor, mass: Tensor, key_ref: Tensor, prior: Tensor,
                   kappa: Tensor, beta: Tensor, boundary: Tensor, sigmoid: bool, chunk_size: int, eps: float,
                   precision: str) -> list[Tensor]:
    """[f, p (sigmoid only: softmax's p is f), the chunk-start key sums, masses]. Inputs in the kernels' layout
    (``_dense``), which torch.compile keeps: a custom op gets its inputs with their eager strides."""
    batch, groups, padded, key_dim = x.shape
    slots = prior.shape[1]
    sizes = _chain_sizes(x, prior, chunk_size, eps)
    options = _launch_options(sigmoid, chunk_size, slots, key_dim, precision)
    f = x.new_empty(batch, groups, padded, slots)
    p = torch.empty_like(f) if sigmoid else f
    sums = x.new_empty(batch, groups, sizes[1] + 1, slots, key_dim)
    masses = x.new_empty(batch, groups, sizes[1] + 1, slots)
    _chain_fwd[(batch * groups,)](x, valid, boundary, key_sum, mass, key_ref, prior, kappa, beta, f, p, sums,
                                  masses, *key_sum.stride()[:2], *mass.stride()[:2],
                                  *_chain_read_strides(key_ref, prior, kappa, beta), *sizes, **options)
    return [f, p, sums, masses] if sigmoid else [f, sums, masses]


@_chain_forward.register_fake
def _(x, valid, key_sum, mass, key_ref, prior, kappa, beta, boundary, sigmoid, chunk_size, eps, precision):
    batch, groups, padded, key_dim = x.shape
    f = x.new_empty(batch, groups, padded, prior.shape[1], dtype=torch.float32)
    sums = f.new_empty(batch, groups, padded // chunk_size + 1, prior.shape[1], key_dim)
    masses = f.new_empty(sums.shape[:-1])
    return [f, torch.empty_like(f), sums, masses] if sigmoid else [f, sums, masses]


@kernel_op(__name__, "chain_backward")
def _chain_backward(x: Tensor, valid: Tensor, boundary: Tensor, key_ref: Tensor, prior: Tensor, kappa: Tensor,
                    beta: Tensor, sums: Tensor, masses: Tensor, d_f: Tensor, d_p: Tensor, d_sums: Tensor,
                    d_masses: Tensor, sigmoid: bool, chunk_size: int, eps: float, precision: str) -> list[Tensor]:
    """[dx and the batch rows' partials packed (``_chain_packed``), d key_sum, d mass, d key_ref, the partials summed
    over the batch (``_shared_gradients``: d prior, d kappa, d beta)]."""
    batch, groups, padded = x.shape[:3]
    sizes = _chain_sizes(x, prior, chunk_size, eps)
    # dx and the partials, in one buffer (the kernel writes all of both)
    packed = x.new_empty(sum(math.prod(shape) for shape in _chain_packed(x, prior)))
    d_x, partials = unpacked(packed, _chain_packed(x, prior))
    d_prior, d_kappa, d_beta = _shared_gradients(partials, prior, 2)
    d_key_sum, d_key_ref = (x.new_empty(batch, groups, *prior.shape[1:]) for _ in range(2))  # written whole
    d_mass = x.new_empty(batch, groups, prior.shape[1])
    scratch = x.new_empty(batch, groups, chunk_size, prior.shape[1])  # (B, G, C, M)
    _chain_bwd[(batch * groups,)](x, valid, boundary, key_ref, prior, kappa, beta, sums, masses, d_f.contiguous(),
                                  d_p.contiguous(), d_sums.contiguous(), d_masses.contiguous(), scratch,
                                  torch.empty_like(scratch), d_x, d_key_sum, d_mass, d_key_ref, d_prior, d_kappa,
                                  d_beta, *_chain_read_strides(key_ref, prior, kappa, beta), partials.stride(0),
                                  *sizes, **_launch_options(sigmoid, chunk_size, prior.shape[1], x.shape[-1],
                                                            precision))
    return [packed, d_key_sum, d_mass, d_key_ref, partials.sum(0)]


def _shared_gradients(partials, prior, scalars: int) -> list[Tensor]:
    """Views of a partials buffer (rows, G*M*D + scalars*G), by rows: the gradients of the parameters every batch
    row shares, kappa P (rows, G, M, D), then ``scalars`` of (rows, G) (kappa [, beta]). A kernel writes one batch
    row each; summed over the rows (``partials.sum(0)``, then rows = 1 squeezed) they are the parameters'
    gradients."""
    groups, size = prior.shape[0], prior[0].numel()
    views = [partials[:, :groups * size].unflatten(1, prior.shape)]
    return views + [partials[:, groups * size + i * groups:groups * size + (i + 1) * groups] for i in range(scalars)]


def _chain_packed(x, prior) -> list[tuple]:
    """The shapes of the chain backward's buffers packed in one: dx, the batch rows' partials (d prior, d kappa,
    d beta)."""
    return [tuple(x.shape), (x.shape[0], prior.numel() + 2 * prior.shape[0])]


@_chain_backward.register_fake
def _(x, valid, boundary, key_ref, prior, kappa, beta, sums, masses, d_f, d_p, d_sums, d_masses, sigmoid,
      chunk_size, eps, precision):
    batch, groups = x.shape[:2]
    new = lambda *shape: x.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return [new(sum(math.prod(shape) for shape in _chain_packed(x, prior))), new(batch, groups, *prior.shape[1:]),
            new(batch, groups, prior.shape[1]), new(batch, groups, *prior.shape[1:]),
            new(prior.numel() + 2 * prior.shape[0])]


def _save_chain(ctx, inputs, output):
    x, valid, key_sum, mass, key_ref, prior, kappa, beta, boundary, sigmoid, chunk_size, eps, precision = inputs
    ctx.save_for_backward(x, valid, boundary, key_ref, prior, kappa, beta, output[-2], output[-1])
    ctx.options = (sigmoid, chunk_size, eps, precision)
    ctx.set_materialize_grads(False)  # a result without a gradient costs no zero tensor unless the kernel needs one


def _given(grads: list, shapes: list, like: Tensor) -> list:
    """``grads`` with each missing one (None where its shape is given) zeros of its shape: views of one zero fill,
    as the kernel only reads them (e.g. the references a training step never reads get none)."""
    missing = [math.prod(shape) for grad, shape in zip(grads, shapes) if grad is None and shape is not None]
    zeros = like.new_zeros(max(missing)) if missing else None
    return [zeros[:math.prod(shape)].view(shape) if grad is None and shape is not None else grad
            for grad, shape in zip(grads, shapes)]


def _chain_gradients(ctx, grads):
    x, valid, boundary, key_ref, prior, kappa, beta, sums, masses = ctx.saved_tensors
    sigmoid = ctx.options[0]
    d_f, d_p, d_sums, d_masses = grads if sigmoid else (grads[0], None, grads[1], grads[2])
    f_shape = (*x.shape[:3], prior.shape[1])
    d_f, d_p, d_sums, d_masses = _given([d_f, d_p, d_sums, d_masses],
                                        [f_shape, f_shape if sigmoid else None, sums.shape, masses.shape], x)
    packed, d_key_sum, d_mass, d_key_ref, shared = _chain_backward(
        x, valid, boundary, key_ref, prior, kappa, beta, sums, masses, d_f, d_p if sigmoid else d_f, d_sums, d_masses,
        *ctx.options)  # softmax: d_f a dummy pointer for d_p
    d_prior, d_kappa, d_beta = (t[0] for t in _shared_gradients(shared[None], prior, 2))
    d_x = unpacked(packed, _chain_packed(x, prior))[0]
    return d_x, None, d_key_sum, d_mass, d_key_ref, d_prior, d_kappa, d_beta, None, None, None, None, None


_chain_forward.register_autograd(_chain_gradients, setup_context=_save_chain)


def _dense(t, inner: int):
    """``t`` in fp32 with its last ``inner`` dimensions contiguous, the kernels' layout; the dimensions before them
    go by their strides (the state's per-level slices and the expanded prototypes are taken as views, uncopied)."""
    t = t.to(torch.float32)
    expected = 1
    for size, stride in reversed(list(zip(t.shape[t.dim() - inner:], t.stride()[t.dim() - inner:]))):
        if size > 1 and stride != expected:
            return t.contiguous()
        expected *= size
    return t


def assign_chain_triton(x, valid, key_sum, mass, key_ref, prior, kappa, beta, boundary, params: RSAParams,
                        precision: str = FP32_DOTS):
    """``rsa_state.assign_chain`` on the kernels: same arguments and results (fp32; gradients reach x, the
    starting sums and references, kappa P, kappa and beta). ``precision``: the dots' operands (module comment)."""
    outputs = _chain_forward(_dense(x, 4), _dense(valid, 2), _dense(key_sum, 2), _dense(mass, 1), _dense(key_ref, 2),
                             _dense(prior, 2), _dense(kappa, 0), _dense(beta, 0), boundary.contiguous(),
                             params.assign_fn == "sigmoid", params.chunk_size, float(params.eps), precision)
    if params.assign_fn == "sigmoid":
        return tuple(outputs)
    f, sums, masses = outputs
    return f, f, sums, masses


def _level_options(residual, relation, chunk_size, slots, key_dim, value_dim, precision) -> dict:
    return dict(RESIDUAL=residual, RELATION=relation, BLOCK_R=tile_edge(chunk_size, ROW_BLOCK),
                BLOCK_M=tile_edge(slots), BLOCK_D=tile_edge(key_dim, FEATURE_BLOCK),
                BLOCK_DV=tile_edge(value_dim, FEATURE_BLOCK), PRECISION=precision)


def _level_read_strides(key_ref0, value_ref0, prior, kappa):
    return (*key_ref0.stride()[:2], *value_ref0.stride()[:2], prior.stride(0), kappa.stride(0))


def _level_shapes(f, key_sum, y, residual, relation) -> list[tuple]:
    """The shapes of ``_level_forward``'s results: W, V, [R], [x_next, y_next], key_ref, value_ref."""
    batch, groups, padded, slots = f.shape
    key_dim, value_dim, boundaries = key_sum.shape[-1], y.shape[-1], key_sum.shape[2]
    return ([tuple(f.shape), (batch, groups, boundaries, slots, value_dim)]
            + ([(batch, groups, boundaries, slots, slots)] if relation else [])
            + ([(batch, groups, padded, key_dim), tuple(y.shape)] if residual else [])
            + [(batch, groups, slots, key_dim), (batch, groups, slots, value_dim)])


@kernel_op(__name__, "level_forward")
def _level_forward(f: Tensor, p: Tensor | None, x: Tensor | None, y: Tensor, valid: Tensor, key_sum: Tensor,
                   mass: Tensor, value_sum0: Tensor, key_ref0: Tensor, value_ref0: Tensor, prior: Tensor,
                   kappa: Tensor, above: Tensor | None, relation_sum0: Tensor | None, boundary: Tensor,
                   chunk_size: int, eps: float, precision: str) -> list[Tensor]:
    """``rsa_state.level_writes`` on the level kernel, inputs in the kernels' layout (``_dense``): p None for softmax
    assignment (it is f), x and p None without a residual, above and the starting relation sum None at level 0.
    Returns W, V, [R], [x_next, y_next], key_ref, value_ref."""
    batch, groups, padded, slots = f.shape
    key_dim, value_dim = key_sum.shape[-1], y.shape[-1]
    chunks = padded // chunk_size
    residual, relation = x is not None, above is not None
    outputs = [f.new_empty(shape) for shape in _level_shapes(f, key_sum, y, residual, relation)]
    written, value_sums, key_ref, value_ref = outputs[0], outputs[1], outputs[-2], outputs[-1]
    dummy = f
    relations = outputs[2] if relation else dummy
    x_next, y_next = outputs[2 + relation:4 + relation] if residual else (dummy, dummy)
    shared = dict(BLOCK_M=tile_edge(slots), PRECISION=precision, num_warps=LEVEL_WARPS,
                  num_stages=CHAIN_STAGES, maxnreg=MAX_REGISTERS)
    # every chunk's increments of V (and R) at once, then their running sums over the boundaries
    value_block = tile_edge(value_dim, FEATURE_BLOCK)
    _level_sums_fwd[(batch * groups, max(chunks, 1), triton.cdiv(value_dim, value_block) + relation)](
        f, y, valid, value_sum0, dummy if above is None else above, dummy if relation_sum0 is None else relation_sum0,
        written, value_sums, relations, *value_sum0.stride()[:2],
        *(relation_sum0.stride()[:2] if relation else (0, 0)), padded, chunks, groups, chunk_size, slots, value_dim,
        RELATION=relation, BLOCK_R=tile_edge(chunk_size, ROW_BLOCK), BLOCK_DV=value_block, **shared)
    value_sums.cumsum_(2)
    if relation:
        relations.cumsum_(2)
    # every chunk's residuals against the references of its start, and the references the state keeps
    final, block = chunks if residual else 0, tile_edge(max(key_dim, value_dim), FEATURE_BLOCK)
    _level_residuals_fwd[(batch * groups, final + 1, triton.cdiv(key_dim, block) + triton.cdiv(value_dim, block))](
        f if p is None else p, dummy if x is None else x, y, boundary, key_sum, mass, value_sums, key_ref0, value_ref0,
        prior, kappa, x_next, y_next, key_ref, value_ref, *_level_read_strides(key_ref0, value_ref0, prior, kappa),
        padded, chunks, final, groups, chunk_size, slots, key_dim, value_dim, eps,
        BLOCK_R=tile_edge(chunk_size, ROW_BLOCK), BLOCK_F=block, **shared)
    return outputs


@_level_forward.register_fake
def _(f, p, x, y, valid, key_sum, mass, value_sum0, key_ref0, value_ref0, prior, kappa, above, relation_sum0, boundary,
      chunk_size, eps, precision):
    return [f.new_empty(shape) for shape in _level_shapes(f, key_sum, y, x is not None, above is not None)]


def _level_gradient_shapes(f, p, y, key_sum, mass, residual, relation) -> list[tuple]:
    """The shapes of ``_level_backward``'s results: by boundary, d key_sum and kappa's share (``_boundary_split``),
    d mass, d key_ref0, d value_ref0, df, [dp], dy, the adjoints of V [and R] by reversed boundary (the last row:
    d value_sum0 [, d relation_sum0]), d prior and d kappa (``_boundary_split`` of the first summed over rows and
    boundaries), [d above]."""
    batch, groups, boundaries, slots, key_dim = key_sum.shape
    value_dim = y.shape[-1]
    return ([(batch, groups, boundaries, slots * key_dim + 1), tuple(mass.shape), (batch, groups, slots, key_dim),
             (batch, groups, slots, value_dim), tuple(f.shape)]
            + ([tuple(f.shape)] if p is not None and residual else [])
            + [tuple(y.shape), (batch, groups, boundaries, slots * value_dim + relation * slots * slots),
               (groups, slots * key_dim + 1)]
            + ([tuple(f.shape)] if relation else []))


def _boundary_split(rows: Tensor, slots: int, key_dim: int) -> tuple[Tensor, Tensor]:
    """(S's gradient (..., M, D), kappa's (...)) as views of rows (..., M * D + 1) of ``_level_backward``."""
    return rows[..., :-1].unflatten(-1, (slots, key_dim)), rows[..., -1]


@kernel_op(__name__, "level_backward")
def _level_backward(f: Tensor, p: Tensor | None, y: Tensor, valid: Tensor, boundary: Tensor, key_sum: Tensor,
                    mass: Tensor, value_sums: Tensor, key_ref0: Tensor, value_ref0: Tensor, prior: Tensor,
                    kappa: Tensor, above: Tensor | None, d_written: Tensor, d_values: Tensor,
                    d_relations: Tensor | None, d_x_next: Tensor | None, d_y_next: Tensor | None,
                    d_key_ref: Tensor | None, d_value_ref: Tensor | None, residual: bool, chunk_size: int,
                    eps: float, precision: str) -> list[Tensor]:
    """The level kernels' backward (``_level_gradient_shapes``), in two passes parallel over boundaries, then over
    chunks and row blocks, with the adjoints of V and R (a cumulative sum over the boundaries) between them; kappa P's
    and kappa's gradients summed over the batch."""
    batch, groups, padded, slots = f.shape
    key_dim, value_dim = key_sum.shape[-1], y.shape[-1]
    chunks = padded // chunk_size
    relation, sigmoid = above is not None, p is not None
    options = dict(_level_options(residual, relation, chunk_size, slots, key_dim, value_dim, precision),
                   num_warps=LEVEL_WARPS, num_stages=CHAIN_STAGES, maxnreg=MAX_REGISTERS)
    sizes = (padded, chunks, groups, chunk_size, slots, key_dim, value_dim, eps)
    strides = _level_read_strides(key_ref0, value_ref0, prior, kappa)
    # read in place by their leading strides where their inner blocks are dense (a level's slice of the stacked
    # levels' gradient is): no copy
    d_values, d_written = _dense(d_values, 2), _dense(d_written, 2)
    d_relations = _dense(d_relations, 2) if relation else f
    d_x_next, d_y_next = (d_x_next.contiguous(), d_y_next.contiguous()) if residual else (f, f)
    kept = d_key_ref is not None  # the kept references' gradients, both or neither (``_level_gradients``)
    d_key_ref, d_value_ref = (d_key_ref.contiguous(), d_value_ref.contiguous()) if kept else (f, f)
    # every element of these is written (boundaries past a row's last one: zeros); by boundary, S's gradient and
    # kappa's share in one row, V's and R's gradients in another (the kernel's docstring)
    boundary_grads = f.new_empty(batch, groups, chunks + 1, slots * key_dim + 1)
    d_mass = torch.empty_like(mass)
    d_key_ref0, d_value_ref0 = torch.empty_like(key_ref0), torch.empty_like(value_ref0)
    adjoints = f.new_empty(batch, groups, chunks + 1, slots * value_dim + relation * slots * slots)
    blocks = triton.cdiv(key_dim, options["BLOCK_D"]) + triton.cdiv(value_dim, options["BLOCK_DV"])
    parts = f.new_empty(batch, groups, chunks + 1, blocks, slots)  # the divisor's, a column block each
    _level_boundaries_bwd[(batch * groups, chunks + 1, blocks)](
        f if p is None else p, boundary, key_sum, mass, value_sums, key_ref0, value_ref0, prior, kappa,
        d_values, d_relations, d_x_next, d_y_next, d_key_ref, d_value_ref, boundary_grads, parts,
        adjoints, d_key_ref0, d_value_ref0, *strides, *d_values.stride()[:3], *d_relations.stride()[:3], *sizes,
        KEPT_GRADS=kept, **options)
    adjoints.cumsum_(2)
    d_f, d_y = torch.empty_like(f), torch.empty_like(y)
    d_p = torch.empty_like(f) if sigmoid and residual else f
    d_above = torch.empty_like(f) if relation else f
    _level_rows_bwd[(batch * groups, max(chunks, 1), triton.cdiv(chunk_size, options["BLOCK_R"]))](
        f, f if p is None else p, y, valid, boundary, key_sum, mass, value_sums, key_ref0, value_ref0, prior, kappa,
        f if above is None else above, d_written, adjoints, parts, d_x_next, d_y_next,
        d_f, d_p, d_y, d_above, boundary_grads, d_mass, *strides, *d_written.stride()[:2], *sizes, SIGMOID=sigmoid,
        BLOCK_S=tile_edge(slots, FEATURE_BLOCK), **options)
    return ([boundary_grads, d_mass, d_key_ref0, d_value_ref0, d_f] + ([d_p] if sigmoid and residual else [])
            + [d_y, adjoints, boundary_grads.sum((0, 2))] + ([d_above] if relation else []))


@_level_backward.register_fake
def _(f, p, y, valid, boundary, key_sum, mass, value_sums, key_ref0, value_ref0, prior, kappa, above, d_written,
      d_values, d_relations, d_x_next, d_y_next, d_key_ref, d_value_ref, residual, chunk_size, eps, precision):
    return [f.new_empty(shape) for shape in _level_gradient_shapes(f, p, y, key_sum, mass, residual,
                                                                   above is not None)]


def _save_level(ctx, inputs, output):
    (f, p, x, y, valid, key_sum, mass, value_sum0, key_ref0, value_ref0, prior, kappa, above, relation_sum0, boundary,
     chunk_size, eps, precision) = inputs
    ctx.save_for_backward(f, p, y, valid, boundary, key_sum, mass, output[1], key_ref0, value_ref0, prior, kappa,
                          above)
    ctx.options = (x is not None, above is not None, chunk_size, eps, precision)
    ctx.set_materialize_grads(False)  # a result without a gradient costs no zero tensor unless the kernel needs one


def _level_gradients(ctx, grads):
    f, p, y, valid, boundary, key_sum, mass, value_sums, key_ref0, value_ref0, prior, kappa, above = ctx.saved_tensors
    residual, relation, chunk_size, eps, precision = ctx.options
    grads = list(grads)
    d_written, d_values = grads.pop(0), grads.pop(0)
    d_relations = grads.pop(0) if relation else None
    d_x_next, d_y_next = (grads.pop(0), grads.pop(0)) if residual else (None, None)
    d_key_ref, d_value_ref = grads
    batch, groups, boundaries = key_sum.shape[:3]
    slots, key_dim, value_dim = f.shape[-1], key_sum.shape[-1], y.shape[-1]
    d_x = d_x_next  # x_next = x - p ref_k: x's gradient passes through
    kept = d_key_ref is not None or d_value_ref is not None  # a training step's loss reads neither: no zeros
    given = _given([d_written, d_values, d_relations, d_x_next, d_y_next, d_key_ref, d_value_ref],
                   [f.shape, value_sums.shape, (batch, groups, boundaries, slots, slots) if relation else None,
                    (*f.shape[:3], key_dim) if residual else None, y.shape if residual else None,
                    (batch, groups, slots, key_dim) if kept else None,
                    (batch, groups, slots, value_dim) if kept else None], f)
    results = list(_level_backward(f, p, y, valid, boundary, key_sum, mass, value_sums, key_ref0, value_ref0, prior,
                                   kappa, above, *given, residual, chunk_size, eps, precision))
    boundary_grads, d_mass, d_key_ref0, d_value_ref0, d_f = results[:5]
    d_key_sum = _boundary_split(boundary_grads, slots, key_dim)[0]
    d_p = results[5] if p is not None and residual else None
    d_y, adjoints, shared = results[5 + (d_p is not None):8 + (d_p is not None)]
    d_prior, d_kappa = _boundary_split(shared, slots, key_dim)
    starting = adjoints[:, :, -1]  # boundary 0's adjoints: the starting sums' gradients
    d_value_sum0 = starting[..., :slots * value_dim].unflatten(-1, (slots, value_dim))
    d_above = results[-1] if relation else None
    d_relation0 = starting[..., slots * value_dim:].unflatten(-1, (slots, slots)) if relation else None
    return (d_f, d_p, d_x, d_y, None, d_key_sum, d_mass, d_value_sum0, d_key_ref0, d_value_ref0, d_prior, d_kappa,
            d_above, d_relation0, None, None, None, None)


_level_forward.register_autograd(_level_gradients, setup_context=_save_level)


def level_writes_triton(f, p, x, y, valid, key_sum, mass, start_value_sum, start_key_ref, start_value_ref, prior,
                        kappa, boundary, params: RSAParams, f_above=None, start_relation_sum=None, residual=True,
                        precision: str = FP32_DOTS):
    """``rsa_state.level_writes`` on the kernels: same arguments and results (fp32). ``precision``: the dots'
    operands (module comment)."""
    sigmoid = params.assign_fn == "sigmoid"
    relation = f_above is not None
    outputs = list(_level_forward(
        _dense(f, 4), _dense(p, 4) if sigmoid and residual else None, _dense(x, 4) if residual else None,
        _dense(y, 4), _dense(valid, 2), _dense(key_sum, 5), _dense(mass, 4), _dense(start_value_sum, 2),
        _dense(start_key_ref, 2), _dense(start_value_ref, 2), _dense(prior, 2), _dense(kappa, 0),
        _dense(f_above, 4) if relation else None, _dense(start_relation_sum, 2) if relation else None,
        boundary.contiguous(), params.chunk_size, float(params.eps), precision))
    written, value_sums = outputs.pop(0), outputs.pop(0)
    relations = outputs.pop(0) if relation else None
    x_next, y_next = (outputs.pop(0), outputs.pop(0)) if residual else (None, None)
    return (written, value_sums, relations, x_next, y_next, *outputs)
