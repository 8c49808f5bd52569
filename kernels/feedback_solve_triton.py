"""Triton kernels for the Sessa feedback solve ``(I - B) s = f``, forward and backward.

Same function as ``feedback_solve_chunked`` (see ``feedback_solve.py`` for the math): per batch row (batch*heads),

    B[t, j] = gain[t] * alpha[t, j],   alpha[t, :] = softmax_{j < P+t, key j real}(scale * <q_t, k_j>)

over the P cached keys and the new keys, shared by every feature column of f (B, T, D). Everything is
accumulated in fp32 whatever the input dtype (fp32 / fp16 / bf16 operands are upcast before every ``tl.dot``,
which also sidesteps the interpreter's broken bf16 dot), and s is returned in fp32. The dots read their operands
as tf32 for bf16 / fp16 inputs and fp32-accurately (three tf32 products) for fp32 ones (``dot_precision``).

Key and value features are taken BLOCK_DK / BLOCK_DV at a time (at most KEY_FEATURE_BLOCK / VALUE_FEATURE_BLOCK,
so feedback heads of any width fit a GPU block's shared memory): the logits <q_t, k_j> sum over key blocks
(``_logits``), dq and dk write one block of their columns per program (GRADIENT_KEY_BLOCK wide).

Forward (``_fwd_kernel``): a chunk pipeline, one program per (batch row, block of value columns, chunk of C rows);
the columns solve apart under the same alpha (each program recomputes the logits). For chunk rows R = c0..c0+C-1:
  1. old keys (the P cached ones, then new rows < c0), in blocks of BLOCK_N, oldest first: each block waits until
     the chunks holding its rows are published (below); the logits are folded into an online softmax (running max
     m, sum z, flash-attention style) while the numerator ``acc = sum_j exp(l_tj - m) s_j`` is rescaled along, so
     only (C, BLOCK_N) logits ever exist;
  2. the chunk's own strictly-earlier keys (a C x C block) join the same running max / sum, so
     ``alpha = exp(l - m) / z`` uses the full-row normaliser over old *and* intra-chunk keys;
  3. rhs = f_R + gain_R * acc / z  (= f_R + B_{R,old} s_old), then the unit-lower C x C solve
     (I - W) s_R = rhs with W = gain * alpha_RR, done exactly by doubling: W is nilpotent (W^C = 0), so
     (I - W)^-1 = (I + W)(I + W^2)(I + W^4)... with ceil(log2 C) factors, i.e. 2*ceil(log2 C) small ``tl.dot``s
     instead of C sequential row updates;
  4. s_R is written and the chunk published: a barrier, then a release increment of its (batch row, column block)'s
     progress counter; a waiting program acquires it before it reads the rows.
The pipeline (kernels/pipeline_triton.py: tickets, progress counters, NaN after a wait that gives up): the chunks'
programs run at once, each reading the keys before its chunk as they are published, so that only the last block
before a chunk and its own solve wait on the previous chunk; the chain of dependent steps is one block and one C x C
solve a chunk, and the launch has B x column blocks x T / C programs where the sweep had B x column blocks (one
feedback head 64 wide, as converted: T / 64 at batch 1).
Saved for the backward: s (B, T, D), h = alpha @ s (B, T, D; the feedback read-out, s = f + gain*h) and the
per-row logsumexp lse (B, T), so alpha[t, j] = exp(scale <q_t, k_j> - lse_t) is recomputed exactly, blockwise.
h and lse are neither computed nor allocated when no gradient is needed (inference, decoding).
Memory: O(T*D + T) per batch row; no T x T matrix is ever formed (tiles are C x BLOCK_N and C x C).

Backward, with lam = (I - B)^-T g and the formulas of ``_ChunkedFeedbackSolve``:
  * ``_bwd_lam_kernel``: the same pipeline in reverse (the last chunk's ticket first), a program per (batch row,
    column block, chunk). Chunk J gathers ``g_J + sum_{t in later chunks} B[t, J]^T lam_t`` over later row blocks,
    the last first, each once its chunks' lam is published, then solves the upper C x C system
    (I - W_JJ)^T lam_J = that, again by doubling. df = lam; and d_gain_t = lam_t . h_t (exact, no division by gain),
    added up over the column blocks.
  * ``_bwd_dq_kernel`` (grid (B, T/BLOCK_M, d/BLOCK_DK), parallel): per query block, over all admissible keys,
    d_logits = gain_t alpha_tj (lam_t . s_j - d_gain_t) (lam_t . s_j summed over column blocks) and
    dq = scale * d_logits @ k.
  * ``_bwd_dk_kernel`` (grid (B, (P+T)/BLOCK_N, d/BLOCK_DK), parallel): per key block (cached and new keys
    alike), over all later query rows, dk = scale * d_logits^T @ q and, for cached keys, d_past_s = B^T lam (the
    cached blocks are skipped when past_k / past_s need no gradient, the usual case for a detached cache).
Both parallel kernels recompute alpha from q, k and lse (like flash attention's dq and dk/dv kernels).

A training call's four kernels compile side by side before its first launch (``_warmups``, the launches' own
argument lists; kernels/triton_compile.py), not one after another at each first launch.

The forward launch and the backward's three are two torch.library ops (``_solve_forward``, ``_solve_backward``):
torch.compile keeps each as one call in its graph. All kernels assume contiguous (B, rows, features) tensors (the
wrapper makes them so). Block sizes are powers
of two >= 16 (a ``tl.dot`` requirement on GPUs); ragged T, d, D and chunk sizes are handled with masks.
"""

from __future__ import annotations

import torch

# A try block on purpose: transformers' remote-code check takes every import outside a try block for a requirement,
# and a saved folder must load where triton is missing. This module is imported only once kernels/dispatch.py has
# chosen the Triton path, which needs triton installed.
try:
    import triton
    import triton.language as tl
finally:
    pass

from .conventions import MAX_REGISTERS, check_feedback_shapes, compute_dtype, dot_precision, kernel_op, tile_edge
from .pipeline_triton import claim, publish, ticket_and_progress, wait_for, zeroed_counters
from .triton_compile import compile_side_by_side

# The dots' operand precision follows the inputs (``dot_precision``). bf16 / fp16 inputs take plain tf32: issue 67's
# emulated check (`hf-mixers bench precision --mixer sessa`) and the interpreter test that rounds these kernels' own
# dot operands keep the step within the bf16 bound, and one product a dot instead of three is what lets the kernels
# fit the register budget below. fp32 inputs keep fp32-accurate dots: the solve feeds its own output back, and a
# caller who asked for fp32 gets it (they spill: a choice of accuracy over speed).
# Tiles: the chunk C, the key / query blocks and the key and value feature blocks are at most 32 wide, and ptxas may
# use at most MAX_REGISTERS a thread. That is issue 67's budget for sm_90 at 4 warps (168, no spill; a 64-row chunk
# or 64-wide feature blocks spill even with tf32), checked on the cubin by tests/unit/test_kernel_resources.py. The
# solve is exact for any C, whatever the caller's chunk_size (the chunked PyTorch form's memory knob); feature
# blocks keep any head width in the kernels (SmolLM2's one 576-wide feedback head, an 8B model's 4096).
MAX_CHUNK = 32
MAX_KEY_BLOCK = 32  # key / query block of the sweeps and the parallel backward kernels
KEY_FEATURE_BLOCK = 32
VALUE_FEATURE_BLOCK = 32
GRADIENT_KEY_BLOCK = 16  # dq / dk: key features a program's columns and its logits' loop take (32 spilled there)
NUM_WARPS = 4  # untuned: tuning (and an autotune config list) needs a GPU
# One software-pipelining stage: the sweep is a chain of dependent steps, so deeper pipelining has little to overlap,
# and Triton's default of 3 buffers every tile load three deep (shared memory an H100 block may lack at wide tiles).
NUM_STAGES = 1


@triton.jit
def _load_rows(past_ptr, new_ptr, pos, P, n_valid, cols, n_cols, PAST_ROWS: tl.constexpr):
    """Rows at absolute positions ``pos`` (BLOCK,) of the virtual concat [past (P rows); new], as fp32.

    Rows >= ``n_valid`` (not yet solved, or past the end) and columns >= ``n_cols`` read as 0. PAST_ROWS: whether
    ``pos`` may hold cached rows (without it, no load of the cache is issued: fewer registers and instructions).
    Returns (BLOCK, BLOCK_COLS).
    """
    col_ok = cols[None, :] < n_cols
    in_new = (pos[:, None] >= P) & (pos[:, None] < n_valid)
    new = tl.load(new_ptr + (pos[:, None] - P) * n_cols + cols[None, :], mask=in_new & col_ok, other=0.0)
    if PAST_ROWS:
        old = tl.load(past_ptr + pos[:, None] * n_cols + cols[None, :], mask=(pos[:, None] < P) & col_ok, other=0.0)
        return old.to(tl.float32) + new.to(tl.float32)
    return new.to(tl.float32)


@triton.jit
def _key_ok(mask_ptr, pos, n_valid, HAS_MASK: tl.constexpr):
    """Which absolute key positions ``pos`` (BLOCK,) exist (< n_valid) and are real tokens."""
    ok = pos < n_valid
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + pos, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _queries(q_ptr, q_rows, q_ok, cols, DK):
    """q (rows, cols) of local rows ``q_rows`` and key feature columns ``cols``, fp32."""
    return tl.load(q_ptr + q_rows[:, None] * DK + cols[None, :], mask=q_ok[:, None] & (cols[None, :] < DK),
                   other=0.0).to(tl.float32)


@triton.jit
def _logits(q_ptr, q_rows, q_ok, past_k_ptr, k_ptr, pos, P, n_valid, DK, scale, q_whole,
            BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DK: tl.constexpr, ONE_KEY_BLOCK: tl.constexpr,
            PRECISION: tl.constexpr, PAST_ROWS: tl.constexpr):
    """scale * <q_t, k_j> (BLOCK_Q, BLOCK_K) for local query rows ``q_rows`` and absolute key positions ``pos``
    over [past; new] (< n_valid), the key features BLOCK_DK at a time. ONE_KEY_BLOCK: they are one block, and
    ``q_whole`` holds the rows' queries already (``_queries``, loaded once outside the caller's loop)."""
    if ONE_KEY_BLOCK:
        return tl.dot(q_whole, tl.trans(_load_rows(past_k_ptr, k_ptr, pos, P, n_valid, tl.arange(0, BLOCK_DK), DK,
                                                   PAST_ROWS)),
                      input_precision=PRECISION) * scale
    total = tl.zeros((BLOCK_Q, BLOCK_K), tl.float32)
    for d0 in range(0, DK, BLOCK_DK):
        cols = d0 + tl.arange(0, BLOCK_DK)
        total += tl.dot(_queries(q_ptr, q_rows, q_ok, cols, DK),
                        tl.trans(_load_rows(past_k_ptr, k_ptr, pos, P, n_valid, cols, DK, PAST_ROWS)),
                        input_precision=PRECISION)
    return total * scale


# Lengths and offsets are plain runtime integers (no specialisation on 1 or on alignment): one compiled kernel per
# layout, whatever the prompt or past length (each compile takes tens of seconds).
@triton.jit(do_not_specialize=["T", "P", "N_CHUNKS"])
def _fwd_kernel(f_ptr, q_ptr, k_ptr, gain_ptr, mask_ptr, past_k_ptr, past_s_ptr,  # inputs
                s_ptr, h_ptr, lse_ptr,  # outputs: s, h (B, T, DV) fp32; lse (B, T) fp32
                ticket_ptr, progress_ptr,  # int32 counters, zeroed: 1 and (B * V_BLOCKS)
                T, P, DK, DV, CHUNK, N_CHUNKS, V_BLOCKS, scale,
                HAS_MASK: tl.constexpr, SAVE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, LOG_C: tl.constexpr, ONE_KEY_BLOCK: tl.constexpr,
                PRECISION: tl.constexpr, PAST_ROWS: tl.constexpr):
    # int64 batch offsets: B*T*D may exceed 2^31
    b, v_block, chunk, progress_ptr = claim(ticket_ptr, progress_ptr, N_CHUNKS, V_BLOCKS)
    f_ptr += b * T * DV
    q_ptr += b * T * DK
    k_ptr += b * T * DK
    gain_ptr += b * T
    mask_ptr += b * (P + T)
    past_k_ptr += b * P * DK
    past_s_ptr += b * P * DV
    s_ptr += b * T * DV
    h_ptr += b * T * DV
    lse_ptr += b * T

    offs_c = tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, BLOCK_N)
    cols_v = v_block * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the columns solve apart: same alpha for each
    lower = offs_c[None, :] < offs_c[:, None]  # strictly lower (C, C): key j < row t inside the chunk

    c0 = chunk * CHUNK
    rows = c0 + offs_c  # local row index (BLOCK_C,)
    row_ok = (offs_c < CHUNK) & (rows < T)

    # (1) old keys: online max / sum and the rescaled numerator acc = sum_j exp(l - m) s_j.
    m_i = tl.full((BLOCK_C,), -1e30, tl.float32)  # finite start: exp(m_old - m_new) never sees -inf - -inf
    z_i = tl.zeros((BLOCK_C,), tl.float32)
    acc = tl.zeros((BLOCK_C, BLOCK_DV), tl.float32)
    n_old = P + c0  # every old key precedes every row of the chunk
    q_c = 0.0  # the chunk's queries, loaded once when the keys are one block (_logits)
    if ONE_KEY_BLOCK:
        q_c = _queries(q_ptr, rows, row_ok, tl.arange(0, BLOCK_DK), DK)
    stalled = 0
    for n0 in range(0, n_old, BLOCK_N):  # the oldest first: published first
        pos = n0 + offs_n  # absolute key positions (BLOCK_N,)
        stalled += wait_for(progress_ptr, (tl.minimum(n0 + BLOCK_N, n_old) - P + CHUNK - 1) // CHUNK)
        key_ok = _key_ok(mask_ptr, pos, n_old, HAS_MASK)
        s_blk = _load_rows(past_s_ptr, s_ptr, pos, P, n_old, cols_v, DV, PAST_ROWS)  # (N, DV), solved rows only
        logits = _logits(q_ptr, rows, row_ok, past_k_ptr, k_ptr, pos, P, n_old, DK, scale, q_c,
                         BLOCK_C, BLOCK_N, BLOCK_DK, ONE_KEY_BLOCK, PRECISION, PAST_ROWS)  # (C, N)
        logits = tl.where(key_ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        corr = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        z_i = z_i * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p, s_blk, input_precision=PRECISION)
        m_i = m_new

    # (2) the chunk's own strictly-earlier keys join the normaliser (their s is not known yet).
    key_c_ok = _key_ok(mask_ptr, P + rows, P + T, HAS_MASK) & row_ok
    allowed = lower & key_c_ok[None, :] & row_ok[:, None]  # (C, C)
    logits = _logits(q_ptr, rows, row_ok, past_k_ptr, k_ptr, P + rows, P, P + T, DK, scale, q_c,
                     BLOCK_C, BLOCK_C, BLOCK_DK, ONE_KEY_BLOCK, PRECISION, False)  # the chunk's own keys: new
    logits = tl.where(allowed, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    corr = tl.exp(m_i - m_new)
    p_cc = tl.exp(logits - m_new[:, None])
    z_i = z_i * corr + tl.sum(p_cc, 1)
    acc = acc * corr[:, None]
    m_i = m_new
    has_key = z_i > 0  # rows with no admissible key get alpha = 0, so s = f exactly
    inv_z = tl.where(has_key, 1.0 / tl.where(has_key, z_i, 1.0), 0.0)

    # (3) rhs = f + gain * alpha_old s_old, then (I - W) s = rhs by doubling.
    gain_c = tl.load(gain_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # (C,)
    f_c = tl.load(f_ptr + rows[:, None] * DV + cols_v[None, :],
                  mask=row_ok[:, None] & (cols_v[None, :] < DV), other=0.0).to(tl.float32)  # (C, DV)
    alpha_cc = p_cc * inv_z[:, None]  # (C, C), exactly 0 off the admissible pattern
    h_old = acc * inv_z[:, None]  # (C, DV)
    s_c = f_c + gain_c[:, None] * h_old
    w_pow = gain_c[:, None] * alpha_cc  # W^(2^i), strictly lower
    for i in tl.static_range(LOG_C):
        s_c += tl.dot(w_pow, s_c, input_precision=PRECISION)
        if i + 1 < LOG_C:
            w_pow = tl.dot(w_pow, w_pow, input_precision=PRECISION)

    # (4) publish the chunk: later chunks read s_c back as values.
    s_c = tl.where(stalled == 0, s_c, float("nan"))
    out_mask = row_ok[:, None] & (cols_v[None, :] < DV)
    tl.store(s_ptr + rows[:, None] * DV + cols_v[None, :], s_c, mask=out_mask)
    if SAVE:  # for the backward: h = alpha @ s over all keys, and the row logsumexp
        h_c = h_old + tl.dot(alpha_cc, s_c, input_precision=PRECISION)
        tl.store(h_ptr + rows[:, None] * DV + cols_v[None, :], h_c, mask=out_mask)
        lse_c = tl.where(has_key, m_i + tl.log(tl.where(has_key, z_i, 1.0)), 0.0)
        first_block = (rows * 0 + v_block) == 0  # every column block has the same lse: one writes it
        tl.store(lse_ptr + rows, lse_c, mask=row_ok & first_block)
    publish(progress_ptr)  # the later chunks' programs read s_c back


@triton.jit(do_not_specialize=["T", "P", "N_CHUNKS"])
def _bwd_lam_kernel(q_ptr, k_ptr, gain_ptr, mask_ptr, lse_ptr, h_ptr, g_ptr,  # inputs (g: dL/ds, fp32)
                    lam_ptr, dgain_ptr,  # outputs: lam = df (B, T, DV) fp32; d_gain (B, T) fp32
                    ticket_ptr, progress_ptr,  # int32 counters, zeroed: 1 and (B * V_BLOCKS)
                    T, P, DK, DV, CHUNK, N_CHUNKS, V_BLOCKS, scale,
                    HAS_MASK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, LOG_C: tl.constexpr,
                    PRECISION: tl.constexpr):
    b, v_block, step, progress_ptr = claim(ticket_ptr, progress_ptr, N_CHUNKS, V_BLOCKS)
    q_ptr += b * T * DK
    k_ptr += b * T * DK
    gain_ptr += b * T
    mask_ptr += b * (P + T)
    lse_ptr += b * T
    h_ptr += b * T * DV
    g_ptr += b * T * DV
    lam_ptr += b * T * DV
    dgain_ptr += b * T

    offs_c = tl.arange(0, BLOCK_C)
    offs_m = tl.arange(0, BLOCK_M)
    cols_v = v_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_col_ok = cols_v < DV  # the chunk's keys are new ones (positions >= P): k_ptr stands in for the cache
    lower = offs_c[None, :] < offs_c[:, None]

    c0 = (N_CHUNKS - 1 - step) * CHUNK  # the reverse order: the last chunk's lam is published first
    rows = c0 + offs_c
    row_ok = (offs_c < CHUNK) & (rows < T)
    key_c_ok = _key_ok(mask_ptr, P + rows, P + T, HAS_MASK) & row_ok
    adj = tl.load(g_ptr + rows[:, None] * DV + cols_v[None, :],
                  mask=row_ok[:, None] & v_col_ok[None, :], other=0.0).to(tl.float32)  # (C, DV)

    # adj_J = g_J + sum over later rows t of B[t, J]^T lam_t (a gather, no read-modify-write).
    later = T - (c0 + CHUNK)  # rows after the chunk, taken from the last block back (published first)
    stalled = 0
    for back in range(0, later, BLOCK_M):
        t0 = tl.maximum(T - back - BLOCK_M, c0 + CHUNK)
        t = t0 + offs_m  # (M,)
        t = tl.where(t < T - back, t, T)  # a first block shorter than BLOCK_M: rows already taken read as none
        stalled += wait_for(progress_ptr, N_CHUNKS - t0 // CHUNK)  # chunks from t0's to the last
        t_ok = t < T
        lse_t = tl.load(lse_ptr + t, mask=t_ok, other=0.0)
        gain_t = tl.load(gain_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        lam_t = tl.load(lam_ptr + t[:, None] * DV + cols_v[None, :],
                        mask=t_ok[:, None] & v_col_ok[None, :], other=0.0)  # (M, DV)
        logits = _logits(q_ptr, t, t_ok, k_ptr, k_ptr, P + rows, P, P + T, DK, scale, 0.0,
                         BLOCK_M, BLOCK_C, BLOCK_DK, False, PRECISION, False)  # (M, C)
        allowed = t_ok[:, None] & key_c_ok[None, :]  # t > j always: t is in a later chunk
        # W = gain * alpha from the saved lse; exp(-inf) = 0 exactly off the admissible pattern.
        w = gain_t[:, None] * tl.exp(tl.where(allowed, logits - lse_t[:, None], float("-inf")))
        adj += tl.dot(tl.trans(w), lam_t, input_precision=PRECISION)

    # (I - W_JJ)^T lam_J = adj_J; W^T is strictly upper and nilpotent, so the same doubling applies.
    lse_c = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    gain_c = tl.load(gain_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    logits = _logits(q_ptr, rows, row_ok, k_ptr, k_ptr, P + rows, P, P + T, DK, scale, 0.0,
                     BLOCK_C, BLOCK_C, BLOCK_DK, False, PRECISION, False)  # (C, C)
    allowed = lower & key_c_ok[None, :] & row_ok[:, None]
    w_pow = tl.trans(gain_c[:, None] * tl.exp(tl.where(allowed, logits - lse_c[:, None], float("-inf"))))
    lam = adj
    for i in tl.static_range(LOG_C):
        lam += tl.dot(w_pow, lam, input_precision=PRECISION)
        if i + 1 < LOG_C:
            w_pow = tl.dot(w_pow, w_pow, input_precision=PRECISION)

    lam = tl.where(stalled == 0, lam, float("nan"))
    h_c = tl.load(h_ptr + rows[:, None] * DV + cols_v[None, :],
                  mask=row_ok[:, None] & v_col_ok[None, :], other=0.0)
    tl.store(lam_ptr + rows[:, None] * DV + cols_v[None, :], lam, mask=row_ok[:, None] & v_col_ok[None, :])
    tl.atomic_add(dgain_ptr + rows, tl.sum(lam * h_c, 1), mask=row_ok)  # d_gain_t = lam_t . h_t, by blocks
    publish(progress_ptr)  # the earlier chunks' programs read this lam back


@triton.jit
def _d_logits(logits, lam_dot_s, lse_t, gain_t, dgain_t, allowed):
    """(d_logits, W) for query rows (M,) x keys (N,), both (M, N): W = gain*alpha, alpha recomputed from lse.

    d_logits = W * (lam_t . s_j - d_gain_t) is the gradient w.r.t. the softmax input scale*<q_t, k_j>, so
    dq = scale * d_logits @ k and dk = scale * d_logits^T @ q (the callers apply ``scale`` once at the end).
    """
    w = gain_t[:, None] * tl.exp(tl.where(allowed, logits - lse_t[:, None], float("-inf")))
    return w * (lam_dot_s - dgain_t[:, None]), w


@triton.jit
def _lam_dot_s(lam_ptr, past_s_ptr, s_ptr, t, t_ok, pos, P, n_valid, DV,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
               PAST_ROWS: tl.constexpr):
    """lam_t . s_j (M, N) for query rows t and key positions pos, over the value columns BLOCK_DV at a time."""
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for v0 in range(0, DV, BLOCK_DV):
        cols_v = v0 + tl.arange(0, BLOCK_DV)
        lam_t = tl.load(lam_ptr + t[:, None] * DV + cols_v[None, :],
                        mask=t_ok[:, None] & (cols_v[None, :] < DV), other=0.0)  # (M, BLOCK_DV)
        s_blk = _load_rows(past_s_ptr, s_ptr, pos, P, n_valid, cols_v, DV, PAST_ROWS)  # (N, BLOCK_DV)
        total += tl.dot(lam_t, tl.trans(s_blk), input_precision=PRECISION)
    return total


@triton.jit
def _load_query_rows(lse_ptr, gain_ptr, dgain_ptr, t, t_ok):
    """lse, gain and d_gain (M,) of local query rows t, all fp32."""
    lse_t = tl.load(lse_ptr + t, mask=t_ok, other=0.0)
    gain_t = tl.load(gain_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
    dgain_t = tl.load(dgain_ptr + t, mask=t_ok, other=0.0)
    return lse_t, gain_t, dgain_t


@triton.jit(do_not_specialize=["T", "P"])
def _bwd_dq_kernel(q_ptr, k_ptr, gain_ptr, mask_ptr, past_k_ptr, past_s_ptr, s_ptr, lse_ptr, lam_ptr, dgain_ptr,
                   dq_ptr,  # output (B, T, DK) fp32
                   T, P, DK, DV, scale,
                   HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, PAST_ROWS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    q_ptr += b * T * DK
    k_ptr += b * T * DK
    gain_ptr += b * T
    mask_ptr += b * (P + T)
    past_k_ptr += b * P * DK
    past_s_ptr += b * P * DV
    s_ptr += b * T * DV
    lse_ptr += b * T
    lam_ptr += b * T * DV
    dgain_ptr += b * T
    dq_ptr += b * T * DK

    offs_n = tl.arange(0, BLOCK_N)
    cols_k = tl.program_id(2) * BLOCK_DK + tl.arange(0, BLOCK_DK)  # this program's block of dq's columns
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,)
    t_ok = t < T
    lse_t, gain_t, dgain_t = _load_query_rows(lse_ptr, gain_ptr, dgain_ptr, t, t_ok)
    dq = tl.zeros((BLOCK_M, BLOCK_DK), tl.float32)
    n_end = P + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1  # keys j < P + t <= n_end
    for n0 in range(0, n_end, BLOCK_N):
        pos = n0 + offs_n
        key_ok = _key_ok(mask_ptr, pos, n_end, HAS_MASK)
        k_blk = _load_rows(past_k_ptr, k_ptr, pos, P, n_end, cols_k, DK, PAST_ROWS)  # (N, BLOCK_DK)
        logits = _logits(q_ptr, t, t_ok, past_k_ptr, k_ptr, pos, P, n_end, DK, scale, 0.0, BLOCK_M, BLOCK_N,
                         BLOCK_DK, False, PRECISION, PAST_ROWS)
        lam_dot_s = _lam_dot_s(lam_ptr, past_s_ptr, s_ptr, t, t_ok, pos, P, n_end, DV, BLOCK_M, BLOCK_N, BLOCK_DV,
                               PRECISION, PAST_ROWS)
        allowed = t_ok[:, None] & key_ok[None, :] & (pos[None, :] < P + t[:, None])
        d_logits, _ = _d_logits(logits, lam_dot_s, lse_t, gain_t, dgain_t, allowed)
        dq += tl.dot(d_logits, k_blk, input_precision=PRECISION)
    tl.store(dq_ptr + t[:, None] * DK + cols_k[None, :], dq * scale,
             mask=t_ok[:, None] & (cols_k[None, :] < DK))


@triton.jit(do_not_specialize=["T", "P", "KEY_START"])
def _bwd_dk_kernel(q_ptr, k_ptr, gain_ptr, mask_ptr, past_k_ptr, past_s_ptr, s_ptr, lse_ptr, lam_ptr, dgain_ptr,
                   dk_ptr, d_past_k_ptr, d_past_s_ptr,  # outputs (B, T, DK), (B, P, DK), (B, P, DV) fp32
                   T, P, DK, DV, KEY_START, scale,
                   HAS_MASK: tl.constexpr, HAS_PAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    q_ptr += b * T * DK
    k_ptr += b * T * DK
    gain_ptr += b * T
    mask_ptr += b * (P + T)
    past_k_ptr += b * P * DK
    past_s_ptr += b * P * DV
    s_ptr += b * T * DV
    lse_ptr += b * T
    lam_ptr += b * T * DV
    dgain_ptr += b * T
    dk_ptr += b * T * DK
    d_past_k_ptr += b * P * DK
    d_past_s_ptr += b * P * DV

    offs_m = tl.arange(0, BLOCK_M)
    cols_k = tl.program_id(2) * BLOCK_DK + tl.arange(0, BLOCK_DK)  # this program's block of dk's columns
    n0 = KEY_START + pid_n * BLOCK_N  # KEY_START = P skips the cached keys when they need no gradient
    pos = n0 + tl.arange(0, BLOCK_N)  # absolute key positions over [past; new] (N,)
    key_ok = _key_ok(mask_ptr, pos, P + T, HAS_MASK)
    in_past = pos[:, None] < P
    dk = tl.zeros((BLOCK_N, BLOCK_DK), tl.float32)
    for t0 in range(tl.maximum(n0 - P, 0), T, BLOCK_M):  # rows before n0 - P + 1 cannot see this block
        t = t0 + offs_m
        t_ok = t < T
        lse_t, gain_t, dgain_t = _load_query_rows(lse_ptr, gain_ptr, dgain_ptr, t, t_ok)
        q_t = _queries(q_ptr, t, t_ok, cols_k, DK)  # (M, BLOCK_DK)
        logits = _logits(q_ptr, t, t_ok, past_k_ptr, k_ptr, pos, P, P + T, DK, scale, 0.0, BLOCK_M, BLOCK_N,
                         BLOCK_DK, False, PRECISION, HAS_PAST)  # cached keys are visited only with HAS_PAST
        lam_dot_s = _lam_dot_s(lam_ptr, past_s_ptr, s_ptr, t, t_ok, pos, P, P + T, DV, BLOCK_M, BLOCK_N, BLOCK_DV,
                               PRECISION, HAS_PAST)
        allowed = t_ok[:, None] & key_ok[None, :] & (pos[None, :] < P + t[:, None])  # (M, N)
        d_logits, w = _d_logits(logits, lam_dot_s, lse_t, gain_t, dgain_t, allowed)
        dk += tl.dot(tl.trans(d_logits), q_t, input_precision=PRECISION)
        if HAS_PAST:  # d past_s_j = sum_t B[t, j] lam_t (for new keys it is inside lam already), by value blocks,
            first = (pos * 0 + tl.program_id(2)) == 0  # written by the programs of the first key-feature block
            for v0 in range(0, DV, BLOCK_DV):
                cols_v = v0 + tl.arange(0, BLOCK_DV)
                lam_t = tl.load(lam_ptr + t[:, None] * DV + cols_v[None, :],
                                mask=t_ok[:, None] & (cols_v[None, :] < DV), other=0.0)
                tl.atomic_add(d_past_s_ptr + pos[:, None] * DV + cols_v[None, :],
                              tl.dot(tl.trans(w), lam_t, input_precision=PRECISION),
                              mask=in_past & first[:, None] & (cols_v[None, :] < DV))
    dk = dk * scale
    k_cols = cols_k[None, :] < DK
    tl.store(dk_ptr + (pos[:, None] - P) * DK + cols_k[None, :], dk,
             mask=(pos[:, None] >= P) & (pos[:, None] < P + T) & k_cols)
    if HAS_PAST:
        tl.store(d_past_k_ptr + pos[:, None] * DK + cols_k[None, :], dk, mask=in_past & k_cols)


def _launch(launches) -> None:
    for kernel, grid, args, constexprs in launches:
        kernel[grid](*args, **constexprs)


def _meta(length, key_dim, width, chunk_size) -> dict:
    chunk = min(chunk_size, MAX_CHUNK, max(length, 1))
    return dict(chunk=chunk, block_c=tile_edge(chunk), log_c=(chunk - 1).bit_length(),
                block_n=tile_edge(chunk, MAX_KEY_BLOCK), block_dk=tile_edge(key_dim, KEY_FEATURE_BLOCK),
                block_dk_grad=tile_edge(key_dim, GRADIENT_KEY_BLOCK),
                block_dv=tile_edge(width, VALUE_FEATURE_BLOCK))


def _pipeline(batch, length, width, meta) -> tuple[int, int, int]:
    """(programs, chunks, value-column blocks) of a chunk pipeline: a program per (batch row, column block, chunk)."""
    chunks, blocks = triton.cdiv(length, meta["chunk"]), triton.cdiv(width, meta["block_dv"])
    return batch * blocks * chunks, chunks, blocks


def _counters(batch, width, meta, device):
    """The pipeline's zeroed counters: the ticket and a progress count per (batch row, value-column block)."""
    return zeroed_counters(batch * triton.cdiv(width, meta["block_dv"]), device)


def _forward_launch(f, q, k, gain, mask, past_k, past_s, s, h, lse, counters, past, scale, meta, save):
    """``_fwd_kernel``'s launch as ``(kernel, grid, args, constexprs)``; s, h, lse and the counters may be dtypes (a
    warmup)."""
    batch, length, width = f.shape
    programs, chunks, blocks = _pipeline(batch, length, width, meta)
    ticket, progress = ticket_and_progress(counters)
    return (_fwd_kernel, (programs,), (
        f, q, k, gain, gain if mask is None else mask, k if not past else past_k, s if not past else past_s,
        s, h, lse, ticket, progress, length, past, q.shape[-1], width, meta["chunk"], chunks, blocks,
        float(scale)), dict(
        HAS_MASK=mask is not None, SAVE=save, BLOCK_C=meta["block_c"], BLOCK_N=meta["block_n"],
        BLOCK_DK=meta["block_dk"], BLOCK_DV=meta["block_dv"], LOG_C=meta["log_c"],
        ONE_KEY_BLOCK=meta["block_dk"] >= q.shape[-1], PRECISION=dot_precision(q.dtype), PAST_ROWS=past > 0,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS))


def _backward_launches(q, k, gain, mask, past_k, past_s, s, lse, h, grad_s, lam, d_gain, counters, dq, dk, d_past_k,
                       d_past_s, batch, length, width, past, scale, meta):
    """The backward's launches in order (the lam pipeline, then dq where wanted, then dk where wanted): ``(kernel,
    grid, args, constexprs)``. A gradient not wanted is None; the buffers may be dtypes (a warmup)."""
    key_dim = q.shape[-1]
    mask_arg = gain if mask is None else mask
    common = dict(HAS_MASK=mask is not None, BLOCK_DK=meta["block_dk"], BLOCK_DV=meta["block_dv"],
                  PRECISION=dot_precision(q.dtype), num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=MAX_REGISTERS)
    programs, chunks, blocks = _pipeline(batch, length, width, meta)
    ticket, progress = ticket_and_progress(counters)
    launches = [(_bwd_lam_kernel, (programs,), (
        q, k, gain, mask_arg, lse, h, grad_s, lam, d_gain, ticket, progress,
        length, past, key_dim, width, meta["chunk"], chunks, blocks, scale), dict(
        BLOCK_C=meta["block_c"], BLOCK_M=meta["block_n"], LOG_C=meta["log_c"], **common))]
    pk = k if not past else past_k
    ps = s if not past else past_s
    block = meta["block_n"]
    key_blocks = triton.cdiv(key_dim, meta["block_dk_grad"])  # dq and dk: one block of their columns per program
    gradient = dict(common, BLOCK_M=block, BLOCK_N=block, BLOCK_DK=meta["block_dk_grad"])
    if dq is not None:
        launches.append((_bwd_dq_kernel, (batch, triton.cdiv(length, block), key_blocks), (
            q, k, gain, mask_arg, pk, ps, s, lse, lam, d_gain, dq,
            length, past, key_dim, width, scale), dict(gradient, PAST_ROWS=past > 0)))
    if dk is not None:  # the dk kernel writes the cached keys' gradients too
        need_past = d_past_k is not None
        key_start = 0 if need_past else past
        launches.append((_bwd_dk_kernel, (batch, triton.cdiv(past + length - key_start, block), key_blocks), (
            q, k, gain, mask_arg, pk, ps, s, lse, lam, d_gain,
            dk, dk if d_past_k is None else d_past_k, dk if d_past_s is None else d_past_s,
            length, past, key_dim, width, key_start, scale), dict(gradient, HAS_PAST=need_past)))
    return launches


def _warmups(f, q, k, gain, mask, past_k, past_s, scale, meta, needs):
    """The launches of a training call: the forward's, then the backward's, with the buffers the kernels write given
    as their dtype (fp32); ``needs``: (dq, dk, the cached keys' gradients) wanted."""
    batch, length, width = f.shape
    past = 0 if past_k is None else past_k.shape[1]
    fp32 = torch.float32
    need_q, need_k, need_past = needs
    counters = torch.int32
    launches = [_forward_launch(f, q, k, gain, mask, past_k, past_s, fp32, fp32, fp32, counters, past, scale, meta,
                                True)]
    return launches + _backward_launches(q, k, gain, mask, past_k, past_s, fp32, fp32, fp32, fp32, fp32, fp32,
                                         counters, fp32 if need_q else None, fp32 if need_k or need_past else None,
                                         fp32 if need_past else None, fp32 if need_past else None,
                                         batch, length, width, past, scale, meta)


def _compile_kernels(f, q, k, gain, mask, past_k, past_s, scale, meta, needs) -> None:
    """On CUDA, compile a training call's kernels side by side before the first launch (kernels/triton_compile.py);
    the layout key: what the kernels are specialised on."""
    if f.device.type == "cuda":  # the interpreter compiles nothing
        key = ("sessa", f.device, f.dtype, q.dtype, k.dtype, gain.dtype, mask is not None, past_k is not None
               and past_k.shape[1] > 0, needs, tuple(sorted(meta.items())), q.shape[-1], f.shape[-1])
        compile_side_by_side("Sessa feedback solve", key,
                             lambda: _warmups(f, q, k, gain, mask, past_k, past_s, scale, meta, needs))


def _prepared(f, q, k, gain, key_mask, past_k, past_s):
    """The kernels' operands: contiguous, the key mask as bytes (1 = real)."""
    f, q, k, gain = f.contiguous(), q.contiguous(), k.contiguous(), gain.contiguous()
    mask = None if key_mask is None else key_mask.bool().contiguous().view(torch.uint8)  # (B, P+T)
    if past_k is not None and past_k.shape[1]:
        past_k, past_s = past_k.contiguous(), past_s.contiguous()
    return f, q, k, gain, mask, past_k, past_s


def _forward(f, q, k, gain, mask, past_k, past_s, scale, meta, save):
    """Launch ``_fwd_kernel`` on prepared operands. Returns s (B, T, D) fp32 and, when ``save``, h (B, T, D) and
    lse (B, T) for the backward (else empty tensors: an op's outputs may not alias each other)."""
    batch, length, width = f.shape
    past = 0 if past_k is None else past_k.shape[1]
    s = torch.empty(batch, length, width, dtype=torch.float32, device=f.device)  # (B, T, D)
    h = torch.empty_like(s) if save else s  # alpha @ s, for d_gain (not allocated for inference)
    lse = torch.empty(batch, length, dtype=torch.float32, device=f.device) if save else s  # (B, T)
    if batch and length:
        _launch([_forward_launch(f, q, k, gain, mask, past_k, past_s, s, h, lse,
                                 _counters(batch, width, meta, f.device), past, scale, meta, save)])
    return (s, h, lse) if save else (s, s.new_empty(0), s.new_empty(0))


# The kernels as torch.library ops, forward and backward: torch.compile keeps each as one opaque call in its graph
# (it never traces a launch), so a block's training step stays one graph and can be captured as a CUDA graph.


@kernel_op(__name__, "solve_forward")
def _solve_forward(f: torch.Tensor, q: torch.Tensor, k: torch.Tensor, gain: torch.Tensor, mask: torch.Tensor | None,
                   past_k: torch.Tensor | None, past_s: torch.Tensor | None, scale: float, chunk_size: int,
                   save: bool, need_q: bool, need_k: bool, need_past: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s (B, T, D) fp32, and h, lse when ``save``; ``need_*``: the gradients a backward will ask for (the
    kernels it compiles side by side with the forward's)."""
    meta = _meta(f.shape[1], q.shape[-1], f.shape[-1], chunk_size)
    if save and f.shape[0] and f.shape[1]:
        _compile_kernels(f, q, k, gain, mask, past_k, past_s, scale, meta, (need_q, need_k, need_past))
    return _forward(f, q, k, gain, mask, past_k, past_s, scale, meta, save)


@_solve_forward.register_fake
def _(f, q, k, gain, mask, past_k, past_s, scale, chunk_size, save, need_q, need_k, need_past):
    s = f.new_empty(f.shape, dtype=torch.float32)
    return (s, torch.empty_like(s), s.new_empty(f.shape[:2])) if save else (s, s.new_empty(0), s.new_empty(0))


def _gradient_shapes(q, s, past_k, need_q, need_k, need_past) -> list[tuple]:
    """The shapes of ``_solve_backward``'s results, (0,) for a gradient not asked for."""
    batch, length, width = s.shape
    key_dim, past = q.shape[-1], 0 if past_k is None else past_k.shape[1]
    return [(batch, length, width), (batch, length, key_dim) if need_q else (0,),
            (batch, length, key_dim) if need_k or need_past else (0,), (batch, length),
            (batch, past, key_dim) if need_past else (0,), (batch, past, width) if need_past else (0,)]


@kernel_op(__name__, "solve_backward")
def _solve_backward(q: torch.Tensor, k: torch.Tensor, gain: torch.Tensor, mask: torch.Tensor | None,
                    past_k: torch.Tensor | None, past_s: torch.Tensor | None, s: torch.Tensor, h: torch.Tensor,
                    lse: torch.Tensor, grad_s: torch.Tensor, scale: float, chunk_size: int, need_q: bool,
                    need_k: bool, need_past: bool) -> list[torch.Tensor]:
    """df, dq, dk, d_gain, d_past_k, d_past_s in fp32 (the dk kernel writes the cached keys' too); (0,) for a
    gradient not asked for."""
    batch, length, width = s.shape
    past = 0 if past_k is None else past_k.shape[1]
    meta = _meta(length, q.shape[-1], width, chunk_size)
    shapes = _gradient_shapes(q, s, past_k, need_q, need_k, need_past)
    lam = torch.empty(shapes[0], dtype=torch.float32, device=s.device)  # df (it is read back by the sweep)
    d_gain = torch.zeros(shapes[3], dtype=torch.float32, device=s.device)  # summed over the value blocks
    dq, dk, d_past_k, d_past_s = ((torch.zeros if len(shape) > 1 else torch.empty)(shape, dtype=torch.float32,
                                                                                  device=s.device)
                                  for shape in (shapes[1], shapes[2], shapes[4], shapes[5]))
    if batch and length:
        wanted = lambda grad: grad if grad.dim() > 1 else None  # noqa: E731
        _launch(_backward_launches(q, k, gain, mask, past_k, past_s, s, lse, h, grad_s.contiguous().float(), lam,
                                   d_gain, _counters(batch, width, meta, s.device), wanted(dq), wanted(dk),
                                   wanted(d_past_k), wanted(d_past_s), batch, length, width, past, scale, meta))
    return [lam, dq, dk, d_gain, d_past_k, d_past_s]


@_solve_backward.register_fake
def _(q, k, gain, mask, past_k, past_s, s, h, lse, grad_s, scale, chunk_size, need_q, need_k, need_past):
    return [s.new_empty(shape) for shape in _gradient_shapes(q, s, past_k, need_q, need_k, need_past)]


def _save_for_backward(ctx, inputs, output):
    f, q, k, gain, mask, past_k, past_s, scale, chunk_size, *_ = inputs
    s, h, lse = output
    ctx.save_for_backward(q, k, gain, mask, past_k, past_s, s, h, lse)
    ctx.options = (scale, chunk_size, f.dtype)
    ctx.set_materialize_grads(False)  # h and lse get no gradient: no zero tensors made for them


def _solve_gradients(ctx, grad_s, _grad_h, _grad_lse):
    q, k, gain, mask, past_k, past_s, s, h, lse = ctx.saved_tensors
    scale, chunk_size, f_dtype = ctx.options
    grad_s = torch.zeros_like(s) if grad_s is None else grad_s
    needs = ctx.needs_input_grad
    need_past = past_k is not None and past_k.shape[1] > 0 and (needs[5] or needs[6])
    lam, dq, dk, d_gain, d_past_k, d_past_s = _solve_backward(q, k, gain, mask, past_k, past_s, s, h, lse, grad_s,
                                                              scale, chunk_size, needs[1], needs[2], need_past)
    cast = lambda grad, like, wanted: grad.to(like.dtype) if wanted else None  # noqa: E731
    return (lam.to(f_dtype), cast(dq, q, needs[1]), cast(dk, k, needs[2]), d_gain.to(gain.dtype), None,
            cast(d_past_k, past_k, need_past), cast(d_past_s, past_s, need_past), None, None, None, None, None, None)


_solve_forward.register_autograd(_solve_gradients, setup_context=_save_for_backward)


def feedback_solve_triton(f, q, k, gain, key_mask=None, past_k=None, past_s=None, scale=None, chunk_size=64):
    """Triton version of ``feedback_solve_chunked``: same arguments, semantics and (fp32) return dtype.

    f (B, T, D), q/k (B, T, d), gain (B, T), key_mask (B, P+T) bool, past_k (B, P, d) / past_s (B, P, D).
    Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before triton was first imported
    (tests only: the interpreter is far slower), in fp32, bf16 or fp16: the kernels compute in fp32, and
    ``feedback_solve`` (the op's entry point) sends fp64 to the PyTorch path.
    """
    check_feedback_shapes(f, q, k, gain, key_mask, past_k, past_s)
    if chunk_size < 1:
        raise ValueError(f"feedback_solve: chunk_size must be >= 1, got {chunk_size}")
    if compute_dtype(f.dtype) != torch.float32:
        raise ValueError(f"feedback_solve_triton: {f.dtype} inputs; the kernels compute in fp32 (feedback_solve "
                         "sends fp64 to the PyTorch path)")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    tensors = (f, q, k, gain) + (() if past_k is None else (past_k, past_s))
    operands = _prepared(f, q, k, gain, key_mask, past_k, past_s)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):  # inference: skip h and lse
        return _solve_forward(*operands, scale, chunk_size, False, False, False, False)[0]
    past = 0 if past_k is None else past_k.shape[1]
    needs = (q.requires_grad, k.requires_grad, past > 0 and (past_k.requires_grad or past_s.requires_grad))
    return _solve_forward(*operands, scale, chunk_size, True, *needs)[0]
