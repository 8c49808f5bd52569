"""Triton kernels for the RSA chunk step (docs/mixers/rsa.md): the read side, forward and backward.

Same function as ``rsa_chunked`` (``rsa_memory.py`` holds the math, this file only re-factors it). One chunk of
C tokens, per KV head, given the chunk-start state (sums: key_sum, value_sum, mass, relation_sum; refs for the
assignments) does two things:

  write side (per KV head, levels in order): F_i = softmax(beta_i tau X_i key_ref_i^T) * valid (C, m) (or the
      sigmoid), the level inputs X_i (C, d), Y_i (C, dv) (level 0: k, v; level i+1: MLP_K(X_i - p key_ref_i),
      MLP_V(Y_i - p value_ref_i)), and the state at the chunk end (key_sum += F_i^T X_i, value_sum += F_i^T Y_i,
      mass += sum_t F_i, relation_sum += F_i^T F_{i+1}; then the refs refresh at a chunk boundary).
  read side (per query head, every row t of the chunk against its *inclusive* state, i.e. the chunk-start sums
      plus rows s <= t of the chunk), with M the inclusive causal C x C mask and N_i = n0_i + M F_i (C, m):
      scores   x_i = tau (q KS0_i^T + ((q X_i^T) . M) F_i) / max(kappa_i + N_i, eps),   KS0 = kappa P + key_sum
      act_i    = sigmoid(x_i) | softmax(x_i [+ log max(N_0, eps) at level 0])             (readout)
      sparse_i = w_a relu(act_i W_i - theta_i) + theta_i / m
      chain_i  = sparse_0 | ((c~ R0_{i-1} + ((c~ F_{i-1}^T) . M) F_i) . sparse_i, c~ = chain_{i-1} / N_{i-1}
                 (relation) | chain_{i-1} . sparse_i (elementwise) | sparse_i (none)
      a_i      = chain_i W_r_i
      read(w)  = w~ VS0_i + ((w~ F_i^T) . M) Y_i,   w~ = w / max(N_i, eps)      (VS0 = value_sum)
      o        = sum_i read(a_i) / max(sum_i |a_i|, eps)  [+ sum_i read(q W_qr_i / 16)]

The per-row inclusive slot state (C copies of an m x d matrix, what a naive chunk form would build) is never
formed: every "state at row t" product is factorised into the chunk-start term plus a C x C causal term, as in
linear attention.

Split of the work:
  * Write side: ``rsa_state.write_chunks`` (shared with the PyTorch chunk form), split along its one recurrence:
    each level's key-assignment chain over the chunks (its assignments depend on the chunk-start state) is one
    launch of kernels/rsa_chain_triton.py, forward and backward; the rest of its write (value and relation sums,
    every chunk's references, the next level's residual inputs) the level kernels there (two launches each way,
    parallel over chunks), and the residual MLPs between levels one launch a level for the key and
    value MLPs (kernels/rsa_mlp_triton.py), each way. The same path with and without autograd.
  * Read side: two launches for *all* chunks of the call (given the write side, the chunks' reads are
    independent). ``_weights_kernel`` (grid (n_chunks x C / PROGRAM_ROWS, B * H), one program = PROGRAM_ROWS rows
    of a chunk x one query head) computes the read weights, all L levels in order inside the program (the chain
    and the global normaliser couple them): a~_i = chain_i W_r_i / max(N_i, eps) as (B, H, L, Tp, m) planes and
    the normaliser. ``_values_kernel`` then reads the values with them, linear in the weights: one program = those
    rows for every query head of a KV head (stacked, so each chunk-start VS0 tile and each F, Y tile is loaded
    once for the group) x VALUE_BLOCK value features. Their rows read the chunk's rows up to themselves, KEY_BLOCK
    at a time: causal products summed over (R, K) blocks; the key features FEATURE_BLOCK at a time.
    The backward splits as FlashAttention-2's does, into a rows side and a keys side, its rows side into what each
    level's chain makes sequential and what it does not: ``_bwd_sums_kernel`` (one launch, every level: grid the
    forward's x L) recomputes each level's causal sums -- N, the score numerator, and d_read = g VS0^T + ((g Y^T) . M) F
    -- and, once, the normaliser's gradient; with relation routing ``_bwd_routing_kernel`` (one launch, levels 1 .. L-1)
    the routed chains from the saved chains; ``_bwd_level_kernel`` is launched once per level, top level first, on the
    forward's grid: from those planes it takes the gradient back through the level's weights (the routing's gradients
    for the level below pass through two (B, H, Tp, m) buffers of the program's own rows) and writes what the query and
    key rows need per level as (B, H, L, Tp, m) planes. ``_bwd_query_kernel`` (one launch) then sums dq over the levels
    and adds the chunk-start key sums' gradient; ``_bwd_keys_kernel`` (one launch, grid chunks x C / KEY_BLOCK, B * G,
    L) sums the planes over the rows and query heads that read each block of keys, owning its F, X, Y gradients (no
    atomics, no whole-chunk accumulator). Products whose operands come from memory are summed FEATURE_BLOCK features or
    slots at a time (``_row_products``: a dot's left operand is every warp's, so an (R, m) one held whole is 32
    registers a thread, twice that split for tf32x3): the (R, m) tiles that are a product's left operand (act, chain,
    c~, a~) go through the planes so. Tiles are at most R x K, R x m, K x m, BLOCK x m and (GS R) x VALUE_BLOCK (the
    values' sums), in registers; fp32 operands and accumulation (an fp16 / bf16 q is copied to fp32 first: the math
    wants fp32, the interpreter's bf16 dot is broken, and one compiled kernel then serves every dtype).

Memory (fp32 unless said otherwise; Tp = T rounded up to the chunk grid, NC = Tp / C chunks):
  * kernel inputs, built by the write side and saved for the backward: F, X, Y (B, G, L, Tp, m | d | dv) and the
    chunk-start sums KS0 (B, G, NB, L, m, d), VS0 (B, G, NB, L, m, dv), n0 (B, G, NB, L, m),
    R0 (B, G, NB, L-1, m, m), NB = NC, or NC + 1 where they are the sums at every boundary, the last one unread (no
    copy of the chunk starts); q (B, H, Tp, d) (an fp32 copy where q is fp16 / bf16). That is
    O(T L (m + d + dv) + T/C L (m d + m dv + m^2)) per KV head and O(T d) per query head: nothing per query head and
    level beyond q itself.
  * forward output (B, H, Tp, dv [+ 1]); when a backward follows, also what it reads (a launch fewer than running
    the forward again): chain_i (B, H, L-1, Tp, m) (only with routing), the numerator (B, H, Tp, dv) and the
    normaliser (B, H, Tp). The backward recomputes the rest of the read side. Transient, between the forward's
    two kernels: the weights planes a~ (and with RSA-q the query weights) (B, H, L, Tp, m), c~ (B, H, Tp, m).
  * backward, transient: 3-5 planes (B, H, L, Tp, m) -- the sums kernel's N, score numerator and d_read, which
    each level's launch replaces with d_n, d_snum and u for the keys kernel; with relation routing the routed
    chains, replaced by d routed; with RSA-q the query weights' gradient --, with relation routing c~
    (B, H, L-1, Tp, m) and the two carries (d chain, d N) from level i + 1 to level i (B, H, Tp, m); the chunk-start
    state's and the parameters' gradients are accumulated with ``tl.atomic_add`` (query heads of a group and all
    chunks / batch rows share them; fp32 atomics make the sums' order, hence the last bits, nondeterministic on
    GPUs). The planes are the price of the split: about 5 L m floats a query head and token
    (Llama-3-8B at 8K: 1.2 GiB a layer's backward, freed after it).

Scope (``rsa_chunk_triton_supports`` returns the reason for anything else): assign_fn softmax | sigmoid (write
side, PyTorch), readout sigmoid | softmax_count, routing relation | elementwise | none, RSA-q on or off, any
L >= 1, the local window's log weight (one more output channel, ``params.log_weight``); no decay (``log_decay``
must be None); fp32 / fp16 / bf16 q, k, v (fp64 is out: fp32 accumulation);
CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests). Chunk size and slots up to MAX_TILE (64), head
dims up to MAX_HEAD_DIM (128: Llama-3-8B's heads; the backward takes them FEATURE_BLOCK features at a time).

Tested under the interpreter (which computes every dot in fp32 whatever ``input_precision`` says) and on a GPU by
tests/gpu/test_kernels_cuda.py; the kernels' registers, spills, shared memory and compile times for sm_90, read
without a GPU by scripts/kernel_resources.py, and their speed are in docs/benchmarks.md. A call's kernels compile
side by side before its first launch (``_Read.compile_kernels``).

The read's forward and backward are torch.library ops (``_read_forward``, ``_read_backward``: torch.compile keeps
each as one call; the forward's saved tensors are outputs marked non-differentiable); the backward's 14 gradients,
which its kernels accumulate into, are zero-filled as one buffer.
"""

from __future__ import annotations

import functools
import math

import torch

# A try block on purpose: transformers' remote-code check takes every import outside a try block for a requirement,
# and a saved folder must load where triton is missing. This module is imported only once kernels/dispatch.py has
# chosen the Triton path (or a test asked for it), which needs triton installed.
try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
finally:
    pass

from .conventions import FP32_DOTS, compute_dtype, kernel_op, packed_zeros, tile_edge, unpacked
from .rsa_state import ChunkLayout, RSAParams, RSAState, slot_prior, write_chunks
# the write side's kernel (the assignment chain), and the tiles and dot precision both sides use: MAX_TILE (chunk
# size and slot count, held as one tile: C x C, C x m and m x m) and MAX_HEAD_DIM (the read's forward holds an
# (R, dv) tile whole, its backward takes FEATURE_BLOCK features at a time); calls over the limits run the PyTorch
# path, said in the dispatch's log line.
from .rsa_chain_triton import assign_chain_triton, level_writes_triton, scope_reason
from .rsa_mlp_triton import residual_mlps_triton
from .triton_compile import compile_side_by_side

# The read's sums -- each row's mass and its value read, N = n0 + M F and a~ VS0 + ((a~ F^T) . M) Y, and their
# gradients -- stay fp32-accurate whatever the inputs (``PRECISION``): the read divides by the masses, and its
# normalised output cancels a read weight's scale, so tf32 operands there take the step's error past the bf16 bound
# at 8K. The read weights' products -- scores, slot mixing (act W, chain W_r), routing -- take the caller's precision
# (``WEIGHT_PRECISION``: tf32 for a bf16 / fp16 call), within the bound (`hf-mixers bench precision --mixer rsa
# --scope read_chunks --keep inclusive_mass --keep read_values`, rsa_memory.py; docs/benchmarks.md). Emulated fp32
# (tf32x3) runs on the tensor cores; as FMA dots ("ieee") the backward held as many registers.
READ_PRECISION = FP32_DOTS
# The forward takes the key features, the backward the key and value features and the slots of the products it
# reads from memory, FEATURE_BLOCK at a time (never held whole): with q held (R, d), KS0 (m, d) whole and 64-wide
# blocks they spilled 600-1,848 bytes on sm_90 (docs/benchmarks.md).
FEATURE_BLOCK = 16
# Rows of a chunk per program, forward and backward: a program's own tiles are (rows, C), (rows, m) and (rows, dv),
# so fewer rows hold fewer registers per thread (and give more programs per launch).
PROGRAM_ROWS = 16
# The values kernel's value features per program: its (GS x PROGRAM_ROWS, dv) sums held whole at Llama-3-8B's
# 128-wide heads and 4 query heads a KV head took 230 registers on sm_90 (123 at 64 wide).
VALUE_BLOCK = 64
KEY_BLOCK = 16  # the chunk rows read per step, and the keys kernel's (at least 16: a tl.dot's least inner dimension)
# 8 warps: the dots' operands are replicated across warps along the rows (a (16, m) tile is one warp's rows), and
# their fp32 split into tf32 halves (tf32x3) is what fills the registers; at 8 warps each holds half the columns.
READ_WARPS = 8
# Software pipelining of the kernels' loops over key blocks and feature blocks (a few iterations each): Triton's
# default of 3 buffers their loads three deep, which took the window's + RSA-q's backward at 128-wide heads past an
# H100 block's shared memory, and in the forward took registers it then spilled (three times the bytes).
READ_STAGES = 1
# The backward's keys kernel (all its products over 16 features or slots at a time) computes its dots as fp32 FMAs
# ("ieee": exact, and its 16 x 16 tiles are too small to fill a tensor core): as tf32x3 it held 210 registers on
# sm_90, the three-pass operand split most of them; as FMAs 106 (docs/benchmarks.md).
KEYS_PRECISION = "ieee"
KEYS_WARPS = 8
READOUTS = {"sigmoid": 0, "softmax_count": 1}
ROUTINGS = {"none": 0, "elementwise": 1, "relation": 2}


def _interpreted() -> bool:
    """Whether this module's kernels run under the Triton CPU interpreter (TRITON_INTERPRET=1 at triton import)."""
    return isinstance(_weights_kernel, InterpretedFunction)


def rsa_chunk_triton_supports(params: RSAParams, q=None, v=None, log_decay=None) -> str | None:
    """None when ``rsa_chunked_triton`` can run this call, else the reason (for a fallback with a log line)."""
    reason = scope_reason(params, v, log_decay)  # decay, assign_fn, tile sizes: shared with the chain kernel
    if reason is not None:
        return reason
    if params.readout not in READOUTS:
        return f"readout {params.readout!r} is not implemented in the Triton RSA kernel (only {sorted(READOUTS)})"
    if params.routing not in ROUTINGS:
        return f"routing {params.routing!r} is not implemented in the Triton RSA kernel (only {sorted(ROUTINGS)})"
    for tensor in (q, v):
        if tensor is not None and tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {tensor.dtype}: the kernels compute in fp32 (fp32 / fp16 / bf16 inputs only)"
    if q is not None:
        if q.device.type != "cuda" and not (q.device.type == "cpu" and _interpreted()):
            return f"{q.device.type} tensors: the kernels need CUDA, or TRITON_INTERPRET=1 set before triton is " \
                   "first imported (CPU interpreter, tests only)"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Kernels. One program = one query head x PROGRAM_ROWS rows of a chunk (the keys kernel: KEY_BLOCK keys of a chunk
# x one KV head x one level). Tiles: rows = the program's chunk rows (R), cols / keys = the chunk's rows they read
# (KEY_BLOCK at a time), slots (m), cols_d / cols_v = key / value features; ``off_xy`` / ``ok_xy`` are the row-major
# offsets / masks of an (x, y) tile with x, y in r (rows), m, d, v; ``*_rows`` the (R, 1) or (K, 1) offsets of
# rows. Pointer offsets are int64 (B*H*Tp*d may exceed 2^31). Tile loads and atomics are mostly written inline:
# under the interpreter every device-function call costs a round of patching.


@triton.jit
def _activation(num, kappa, n, slot_ok, tau, eps, LEVEL0, READOUT: tl.constexpr):
    """The scores tau num / max(kappa + N, eps), their denominator and the readout activation, from the score
    numerator num = q KS0^T + ((q X^T) . M) F (rows, m); the activation is 0 on padded slots. ``LEVEL0`` (level 0:
    the count prior) is a constexpr in the backward, a runtime flag in the forward's level loop."""
    den = tl.maximum(kappa + n, eps)
    score = tau * num / den
    if READOUT == 1:  # softmax_count: a count prior log N on level 0 only
        z = score
        if LEVEL0:
            z = z + tl.log(tl.maximum(n, eps))
        z = tl.where(slot_ok[None, :], z, float("-inf"))
        e = tl.exp(z - tl.max(z, 1)[:, None])
        act = e / tl.sum(e, 1)[:, None]
    else:
        act = tl.where(slot_ok[None, :], tl.sigmoid(score), 0.0)
    return score, den, act


@triton.jit
def _row_products(a_ptr, a_at, a_ok, b_ptr, b_at, b_ok, width, b_step, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """A B^T (R, N) for A (R, width) row-major, its rows starting at ``a_at`` (R, 1), and B (N, width) whose element
    (n, c) is at ``b_at[n] + c * b_step``, summed over BLOCK columns at a time: the operands are never held whole (a
    dot's left operand is every warp's)."""
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for c0 in range(0, width, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        a = tl.load(a_ptr + a_at + col[None, :], mask=a_ok & (col < width)[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + b_at + col[None, :] * b_step, mask=b_ok & (col < width)[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    return acc


@triton.jit
def _row_program(C, H, G, GS, BLOCK_R: tl.constexpr):
    """This program's place on the read's grid (chunks x C / BLOCK_R, B * H [, levels]): its chunk, (b, query head)
    and (b, KV head), the chunk's first row in the padded sequence, its BLOCK_R rows of the chunk, and the end of
    the chunk rows they read, [0, reach)."""
    row_blocks = tl.cdiv(C, BLOCK_R)
    chunk = (tl.program_id(0) // row_blocks).to(tl.int64)
    bh = tl.program_id(1).to(tl.int64)  # b * H + head
    bg = (bh // H) * G + (bh % H) // GS  # (b, KV head) of this query head
    first = (tl.program_id(0) % row_blocks) * BLOCK_R
    return chunk, bh, bg, chunk * C, first + tl.arange(0, BLOCK_R), tl.minimum(first + BLOCK_R, C)


# Lengths, the level and the save flag are plain runtime integers (no specialisation on 1 or on alignment): one
# compiled kernel per layout and options, whatever the sequence length. The levels are a loop, not unrolled (unrolled,
# the compiler overlaps them and holds more registers). Every product whose left operand is an (R, m) tile computed
# here (act W, c~ R0, c~ F^T, chain W_r) reads it back from memory BLOCK_S slots at a time (``_row_products``): a
# dot's left operand is every warp's, so one held whole is 32 registers a thread at m = 64 (twice that split for
# tf32x3); held whole, the read took 218-255 registers on sm_90 against 128 so (docs/benchmarks.md).
@triton.jit(do_not_specialize=["Tp", "NB", "save"])
def _weights_kernel(q_ptr, f_ptr, x_ptr, y_ptr, ks0_ptr, vs0_ptr, n0_ptr, r0_ptr, kappa_ptr,
                    w_ptr, wr_ptr, theta_ptr, wa_ptr, wqr_ptr,
                    weights_ptr, query_ptr, scaled_ptr, lw_ptr, chain_ptr, den_ptr,
                    Tp, NB, H, G, GS, C, M, D, DV, tau, eps, theta_max, save,
                    L: tl.constexpr, READOUT: tl.constexpr, ROUTING: tl.constexpr, QUERY_READ: tl.constexpr,
                    LOG_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                    WEIGHT_PRECISION: tl.constexpr):
    """The read weights of BLOCK_R rows of one chunk x one query head, all levels in order (the chain couples
    them): a~_i = chain_i W_r_i / max(N_i, eps) into ``weights`` (B, H, L, Tp, m), which also serves as the
    scratch that act_i and chain_i are read back from; the normaliser sum_i |a_i| into ``den`` (B, H, Tp); with
    RSA-q the query weights q W_qr_i / 16 / max(N_i, eps) into ``query`` (B, H, L, Tp, m); with relation routing
    c~_i = chain_i / max(N_i, eps) into ``scaled`` (B, H, Tp, m, one level at a time); the log weight (LOG_WEIGHT)
    and, with ``save``, chain_i (i < L - 1) for the backward. Its rows read the chunk-start state and the chunk's
    rows up to themselves, BLOCK_K at a time; the products over the key features BLOCK_D of them at a time."""
    chunk, bh, bg, row0, rows, reach = _row_program(C, H, G, GS, BLOCK_R)
    head = bh % H
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    row_ok, slot_ok = rows < C, slots < M
    ok_rm = row_ok[:, None] & slot_ok[None, :]
    scaled_rows = (bh * Tp + row0 + rows)[:, None] * M  # (R, 1) rows of the (B, H, Tp, m) c~ scratch

    chain = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    for i in range(L):
        level_row = (bg * L + i) * Tp + row0  # row of (B, G, L, Tp, .) level tensors
        state = (bg * NB + chunk) * L + i  # index of (B, G, NB, L, ...) chunk-start sums
        plane_rows = ((bh * L + i) * Tp + row0 + rows)[:, None] * M  # (R, 1) rows of (B, H, L, Tp, m) planes
        # the inclusive running mass N = n0 + M F and the score numerator q KS0^T + ((q X^T) . M) F, (R, m)
        n = tl.zeros((BLOCK_R, BLOCK_M), tl.float32) + tl.load(n0_ptr + state * M + slots, mask=slot_ok,
                                                                other=0.0)[None, :]
        snum = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)
        for k0 in range(0, reach, BLOCK_K):
            cols = k0 + keys
            causal = (cols[None, :] <= rows[:, None]).to(tl.float32)  # (R, K), inclusive
            f = tl.load(f_ptr + (level_row + cols)[:, None] * M + slots[None, :],
                        mask=(cols < reach)[:, None] & slot_ok[None, :], other=0.0)
            n += tl.dot(causal, f, input_precision=PRECISION)
            q_x = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
            for d0 in range(0, D, BLOCK_D):  # q X^T, BLOCK_D features at a time
                part = d0 + tl.arange(0, BLOCK_D)
                q_part = tl.load(q_ptr + (bh * Tp + row0 + rows)[:, None] * D + part[None, :],
                                 mask=row_ok[:, None] & (part < D)[None, :], other=0.0)
                x = tl.load(x_ptr + (level_row + cols)[:, None] * D + part[None, :],
                            mask=(cols < reach)[:, None] & (part < D)[None, :], other=0.0)
                q_x += tl.dot(q_part, tl.trans(x), input_precision=WEIGHT_PRECISION)
            snum += tl.dot(q_x * causal, f, input_precision=WEIGHT_PRECISION)
        snum += _row_products(q_ptr, (bh * Tp + row0 + rows)[:, None] * D, row_ok[:, None], ks0_ptr,
                              (state * M + slots)[:, None] * D, slot_ok[:, None], D, 1, BLOCK_R, BLOCK_M, BLOCK_D,
                              WEIGHT_PRECISION)  # q KS0^T
        norm_n = tl.maximum(n, eps)
        kappa = tl.load(kappa_ptr + (bg % G) * L + i)
        score, _, act = _activation(snum, kappa, n, slot_ok, tau, eps, i == 0, READOUT)
        if LOG_WEIGHT:
            if i == 0:  # log sum_j N_j exp(score_j) over the real level-0 slots (the window's merge)
                z = tl.where(slot_ok[None, :], score + tl.log(norm_n), float("-inf"))
                z_max = tl.max(z, 1)
                tl.store(lw_ptr + bh * Tp + row0 + rows, z_max + tl.log(tl.sum(tl.exp(z - z_max[:, None]), 1)),
                         mask=row_ok)
        hl = head * L + i
        if QUERY_READ:  # q W_qr / 16 / max(N, eps), read by the values kernel outside the normaliser
            query_weights = _row_products(q_ptr, (bh * Tp + row0 + rows)[:, None] * D, row_ok[:, None], wqr_ptr,
                                          hl * D * M + slots[:, None], slot_ok[:, None], D, M, BLOCK_R, BLOCK_M,
                                          BLOCK_D, PRECISION)
            tl.store(query_ptr + plane_rows + slots[None, :], query_weights / 16 / norm_n, mask=ok_rm)
        # sparse = w_a relu(act W - theta) + theta / m on real slots; act read back from the weights plane
        tl.store(weights_ptr + plane_rows + slots[None, :], act, mask=ok_rm)
        tl.debug_barrier()  # act written before its slot blocks are read back
        theta = tl.minimum(tl.maximum(tl.load(theta_ptr + hl), 0.0), theta_max)  # as learned, clamped here
        mixed = _row_products(weights_ptr, plane_rows, row_ok[:, None], w_ptr, hl * M * M + slots[:, None],
                              slot_ok[:, None], M, M, BLOCK_R, BLOCK_M, BLOCK_S, WEIGHT_PRECISION)  # act W
        sparse = tl.where(slot_ok[None, :], tl.load(wa_ptr + hl) * tl.maximum(mixed - theta, 0.0) + theta / M, 0.0)
        if ROUTING == 0:
            chain = sparse
        elif i == 0:
            chain = sparse
        elif ROUTING == 1:
            chain = chain * sparse
        else:  # relation: c~_{i-1} routed through the inclusive relation matrix R0 + causal F_{i-1}^T F_i
            relation = ((bg * NB + chunk) * (L - 1) + i - 1) * M * M
            routed = _row_products(scaled_ptr, scaled_rows, row_ok[:, None], r0_ptr, relation + slots[:, None],
                                   slot_ok[:, None], M, M, BLOCK_R, BLOCK_M, BLOCK_S, WEIGHT_PRECISION)
            for k0 in range(0, reach, BLOCK_K):
                cols = k0 + keys
                key_ok = (cols < reach)[:, None]
                intra = _row_products(scaled_ptr, scaled_rows, row_ok[:, None], f_ptr, (level_row - Tp + cols)[:, None]
                                      * M, key_ok, M, 1, BLOCK_R, BLOCK_K, BLOCK_S, WEIGHT_PRECISION)
                f = tl.load(f_ptr + (level_row + cols)[:, None] * M + slots[None, :], mask=key_ok & slot_ok[None, :],
                            other=0.0)
                routed += tl.dot(intra * (cols[None, :] <= rows[:, None]).to(tl.float32), f,
                                 input_precision=WEIGHT_PRECISION)
            chain = routed * sparse
        if ROUTING != 0 and i < L - 1:
            if save:  # the backward reads chain_i back at level i + 1
                tl.store(chain_ptr + ((bh * (L - 1) + i) * Tp + row0 + rows)[:, None] * M + slots[None, :], chain,
                         mask=ok_rm)
        # a = chain W_r, chain read back from the weights plane (act's blocks all read first)
        tl.debug_barrier()
        tl.store(weights_ptr + plane_rows + slots[None, :], chain, mask=ok_rm)
        if ROUTING == 2 and i < L - 1:  # c~_i for level i + 1 (its blocks of c~_{i-1} all read above)
            tl.store(scaled_ptr + scaled_rows + slots[None, :], chain / norm_n, mask=ok_rm)
        tl.debug_barrier()
        a = _row_products(weights_ptr, plane_rows, row_ok[:, None], wr_ptr, hl * M * M + slots[:, None],
                          slot_ok[:, None], M, M, BLOCK_R, BLOCK_M, BLOCK_S, WEIGHT_PRECISION)
        den += tl.sum(tl.abs(a), 1)  # total absolute read weight (rsa_memory.py docstring)
        tl.debug_barrier()  # chain's blocks all read before a~ takes its place
        tl.store(weights_ptr + plane_rows + slots[None, :], a / norm_n, mask=ok_rm)
    tl.store(den_ptr + bh * Tp + row0 + rows, den, mask=row_ok)


@triton.jit(do_not_specialize=["Tp", "NB", "save"])
def _values_kernel(f_ptr, y_ptr, vs0_ptr, weights_ptr, query_ptr, den_ptr, out_ptr, num_ptr,
                   Tp, NB, H, G, GS, C, M, DV, eps, save,
                   L: tl.constexpr, QUERY_READ: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    """The read of BLOCK_R rows of one chunk for every query head of one KV head: read(w~) = w~ VS0_i +
    ((w~ F_i^T) . M) Y_i summed over the levels for w~ = a~_i (``weights``, from ``_weights_kernel``) into num, and
    for the RSA-q query weights (``query``) into extra; out = num / max(den, eps) + extra (B, H, Tp, dv), and num
    itself with ``save``. The group's GS query heads are stacked as BLOCK_G x BLOCK_R rows (BLOCK_G = GS rounded up
    to a power of two), so each tile of VS0, F and Y is loaded once for all of them. The weights are read BLOCK_S
    slots at a time (never held whole), the chunk's rows BLOCK_K at a time."""
    row_blocks = tl.cdiv(C, BLOCK_R)
    chunk = (tl.program_id(0) // row_blocks).to(tl.int64)
    bg = tl.program_id(1).to(tl.int64)  # b * G + KV head
    row0 = chunk * C
    first = (tl.program_id(0) % row_blocks) * BLOCK_R
    stacked = tl.arange(0, BLOCK_G * BLOCK_R)
    rows = first + stacked % BLOCK_R  # each stacked row's row of the chunk
    bh = (bg // G) * H + (bg % G) * GS + stacked // BLOCK_R  # and its (b, query head)
    reach = tl.minimum(first + BLOCK_R, C)
    keys = tl.arange(0, BLOCK_K)
    cols_v = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # this program's value features
    row_ok, v_ok = (rows < C) & (stacked // BLOCK_R < GS), cols_v < DV
    num = tl.zeros((BLOCK_G * BLOCK_R, BLOCK_DV), tl.float32)
    extra = tl.zeros((BLOCK_G * BLOCK_R, BLOCK_DV), tl.float32)  # RSA-q branch, outside the normaliser
    for i in range(L):
        level_row = (bg * L + i) * Tp + row0
        values_at = ((bg * NB + chunk) * L + i) * M * DV + cols_v[:, None]  # VS0_i^T's rows: (dv, 1)
        plane_rows = ((bh * L + i) * Tp + row0 + rows)[:, None] * M
        num += _row_products(weights_ptr, plane_rows, row_ok[:, None], vs0_ptr, values_at, v_ok[:, None], M, DV,
                             BLOCK_G * BLOCK_R, BLOCK_DV, BLOCK_S, PRECISION)
        if QUERY_READ:
            extra += _row_products(query_ptr, plane_rows, row_ok[:, None], vs0_ptr, values_at, v_ok[:, None], M,
                                   DV, BLOCK_G * BLOCK_R, BLOCK_DV, BLOCK_S, PRECISION)
        for k0 in range(0, reach, BLOCK_K):
            cols = k0 + keys
            key_ok = (cols < reach)[:, None]
            causal = (cols[None, :] <= rows[:, None]).to(tl.float32)
            y = tl.load(y_ptr + (level_row + cols)[:, None] * DV + cols_v[None, :], mask=key_ok & v_ok[None, :],
                        other=0.0)
            key_rows = (level_row + cols)[:, None] * M
            weights_f = _row_products(weights_ptr, plane_rows, row_ok[:, None], f_ptr, key_rows, key_ok, M, 1,
                                      BLOCK_G * BLOCK_R, BLOCK_K, BLOCK_S, PRECISION)  # a~ F^T
            num += tl.dot(weights_f * causal, y, input_precision=PRECISION)
            if QUERY_READ:
                query_f = _row_products(query_ptr, plane_rows, row_ok[:, None], f_ptr, key_rows, key_ok, M, 1,
                                        BLOCK_G * BLOCK_R, BLOCK_K, BLOCK_S, PRECISION)
                extra += tl.dot(query_f * causal, y, input_precision=PRECISION)
    out_at = (bh * Tp + row0 + rows)[:, None] * DV + cols_v[None, :]
    ok_rv = row_ok[:, None] & v_ok[None, :]
    den = tl.load(den_ptr + bh * Tp + row0 + rows, mask=row_ok, other=1.0)
    tl.store(out_ptr + out_at, num / tl.maximum(den, eps)[:, None] + extra, mask=ok_rv)
    if save:
        tl.store(num_ptr + out_at, num, mask=ok_rv)


@triton.jit(do_not_specialize=["Tp", "NB"])
def _bwd_sums_kernel(q_ptr, f_ptr, x_ptr, y_ptr, ks0_ptr, vs0_ptr, n0_ptr, g_ptr, num_ptr, den_ptr,
                     n_ptr, snum_ptr, read_ptr, d_den_ptr, Tp, NB, H, G, GS, C, M, D, DV, eps,
                     L: tl.constexpr, LOG_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                     WEIGHT_PRECISION: tl.constexpr):
    """The backward's first launch, every level at once (grid: the forward's x L; none depends on another level):
    each row's causal sums of level i, recomputed as the forward computes them, into (B, H, L, Tp, m) planes for
    ``_bwd_level_kernel``: the inclusive mass N = n0 + M F (``n``), the score numerator q KS0^T + ((q X^T) . M) F
    (``snum``) and the read's gradient before its normalisers, d_read = g VS0^T + ((g Y^T) . M) F (``read``). The
    planes are those the level kernel then overwrites with what the keys kernel reads (d_n, d_snum, u). Level 0's
    programs also write the normaliser's gradient, which every level reads: out = num / max(den, eps) + extra, so
    d den = -sum_v g num / max(den, eps)^2 where den >= eps (``d_den``, (B, H, Tp))."""
    chunk, bh, bg, row0, rows, reach = _row_program(C, H, G, GS, BLOCK_R)
    i = tl.program_id(2)
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    slot_ok, row_ok = slots < M, (rows < C)[:, None]
    level_row = (bg * L + i) * Tp + row0
    state = (bg * NB + chunk) * L + i
    q_rows = bh * Tp + row0 + rows[:, None]  # (R, 1) rows of (B, H, Tp, .) tensors
    g_stride = DV + LOG_WEIGHT  # g's rows carry the log weight's gradient as one more channel
    state_rows = (state * M + slots)[:, None]  # (m, 1) rows of the chunk-start sums KS0 (., d), VS0 (., dv)
    n = tl.zeros((BLOCK_R, BLOCK_M), tl.float32) + tl.load(n0_ptr + state * M + slots, mask=slot_ok,
                                                            other=0.0)[None, :]
    snum = _row_products(q_ptr, q_rows * D, row_ok, ks0_ptr, state_rows * D, slot_ok[:, None], D, 1,
                         BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)
    d_read = _row_products(g_ptr, q_rows * g_stride, row_ok, vs0_ptr, state_rows * DV, slot_ok[:, None], DV, 1,
                           BLOCK_R, BLOCK_M, BLOCK, PRECISION)
    for k0 in range(0, reach, BLOCK_K):
        cols_k = k0 + keys
        key_ok = (cols_k < reach)[:, None]
        causal = (cols_k[None, :] <= rows[:, None]).to(tl.float32)  # (R, K), inclusive
        key_rows = level_row + cols_k[:, None]
        f = tl.load(f_ptr + key_rows * M + slots[None, :], mask=key_ok & slot_ok[None, :], other=0.0)
        n += tl.dot(causal, f, input_precision=PRECISION)
        q_x = _row_products(q_ptr, q_rows * D, row_ok, x_ptr, key_rows * D, key_ok, D, 1, BLOCK_R, BLOCK_K, BLOCK,
                            WEIGHT_PRECISION)
        snum += tl.dot(q_x * causal, f, input_precision=WEIGHT_PRECISION)
        g_y = _row_products(g_ptr, q_rows * g_stride, row_ok, y_ptr, key_rows * DV, key_ok, DV, 1, BLOCK_R, BLOCK_K,
                            BLOCK, PRECISION)
        d_read += tl.dot(g_y * causal, f, input_precision=PRECISION)
    plane_at = ((bh * L + i) * Tp + row0 + rows[:, None]) * M + slots[None, :]
    ok_rm = row_ok & slot_ok[None, :]
    tl.store(n_ptr + plane_at, n, mask=ok_rm)
    tl.store(snum_ptr + plane_at, snum, mask=ok_rm)
    tl.store(read_ptr + plane_at, d_read, mask=ok_rm)
    if i == 0:
        g_num = tl.zeros((BLOCK_R,), tl.float32)  # sum_v g num
        for v0 in range(0, DV, BLOCK):
            cv = v0 + tl.arange(0, BLOCK)
            ok_rv = row_ok & (cv < DV)[None, :]
            g = tl.load(g_ptr + q_rows * g_stride + cv[None, :], mask=ok_rv, other=0.0)
            g_num += tl.sum(g * tl.load(num_ptr + q_rows * DV + cv[None, :], mask=ok_rv, other=0.0), 1)
        den = tl.load(den_ptr + bh * Tp + row0 + rows, mask=rows < C, other=0.0)
        norm = tl.maximum(den, eps)
        tl.store(d_den_ptr + bh * Tp + row0 + rows, tl.where(den >= eps, -g_num / (norm * norm), 0.0), mask=rows < C)


@triton.jit(do_not_specialize=["Tp", "NB"])
def _bwd_routing_kernel(f_ptr, r0_ptr, chain_ptr, n_ptr, routed_ptr, scaled_ptr, Tp, NB, H, G, GS, C, M, eps,
                        L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK: tl.constexpr, WEIGHT_PRECISION: tl.constexpr):
    """With relation routing, after the sums kernel, levels i = 1 .. L-1 at once (grid: the forward's x L - 1): the
    routed chain of level i, c~ R0 + ((c~ F_{i-1}^T) . M) F_i, recomputed as the forward does from the saved
    chain_{i-1} and the sums kernel's N_{i-1}, into the d routed plane (``routed``) for ``_bwd_level_kernel``, and
    c~ = chain_{i-1} / max(N_{i-1}, eps) into ``scaled`` (B, H, L-1, Tp, m), which the level and keys kernels read
    and the products here read back a block of slots at a time."""
    chunk, bh, bg, row0, rows, reach = _row_program(C, H, G, GS, BLOCK_R)
    i = tl.program_id(2) + 1
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    slot_ok, row_ok = slots < M, (rows < C)[:, None]
    ok_rm = row_ok & slot_ok[None, :]
    level_row = (bg * L + i) * Tp + row0
    plane_at = ((bh * L + i) * Tp + row0 + rows[:, None]) * M + slots[None, :]
    chain_rows = ((bh * (L - 1) + i - 1) * Tp + row0 + rows[:, None]) * M  # (R, 1): chain_{i-1}'s rows
    chain_prev = tl.load(chain_ptr + chain_rows + slots[None, :], mask=ok_rm, other=0.0)
    n_prev = tl.load(n_ptr + plane_at - Tp * M, mask=ok_rm, other=0.0)  # N_{i-1}
    tl.store(scaled_ptr + chain_rows + slots[None, :], chain_prev / tl.maximum(n_prev, eps), mask=ok_rm)
    tl.debug_barrier()
    r0_at = ((bg * NB + chunk) * (L - 1) + i - 1) * M * M
    routed = _row_products(scaled_ptr, chain_rows, row_ok, r0_ptr + r0_at, slots[:, None], slot_ok[:, None], M, M,
                           BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)  # c~ R0
    for k0 in range(0, reach, BLOCK_K):
        cols_k = k0 + keys
        key_ok = (cols_k < reach)[:, None]
        key_rows = level_row + cols_k[:, None]
        f = tl.load(f_ptr + key_rows * M + slots[None, :], mask=key_ok & slot_ok[None, :], other=0.0)
        intra_prev = _row_products(scaled_ptr, chain_rows, row_ok, f_ptr, (key_rows - Tp) * M, key_ok, M, 1,
                                   BLOCK_R, BLOCK_K, BLOCK, WEIGHT_PRECISION)
        routed += tl.dot(intra_prev * (cols_k[None, :] <= rows[:, None]).to(tl.float32), f,
                         input_precision=WEIGHT_PRECISION)
    tl.store(routed_ptr + plane_at, routed, mask=ok_rm)


@triton.jit(do_not_specialize=["Tp", "NB", "i"])
def _bwd_level_kernel(q_ptr, f_ptr, x_ptr, y_ptr, ks0_ptr, vs0_ptr, n0_ptr, r0_ptr, kappa_ptr,
                      w_ptr, wr_ptr, theta_ptr, wa_ptr, wqr_ptr,
                      g_ptr, chain_ptr, scaled_ptr, den_ptr, d_den_ptr,  # dL/d out (B, H, Tp, dv [+ 1]); chain_i,
                      # and c~_i = chain_{i-1} / N_{i-1} (B, H, L-1, Tp, m) from the routing kernel; den, d den
                      d_chain_ptr, dn_next_ptr,  # (B, H, Tp, m) each: level i + 1's gradients for level i's rows
                      u_ptr, d_snum_ptr, d_n_ptr, d_routed_ptr, d_query_ptr,  # (B, H, L, Tp, m) each
                      dvs0_ptr, dn0_ptr, dr0_ptr, dkappa_ptr, dw_ptr, dwr_ptr, dtheta_ptr, dwa_ptr,  # added into
                      Tp, NB, H, G, GS, C, M, D, DV, tau, eps, theta_max, i,
                      L: tl.constexpr, READOUT: tl.constexpr, ROUTING: tl.constexpr, QUERY_READ: tl.constexpr,
                      LOG_WEIGHT: tl.constexpr, LEVEL0: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      WEIGHT_PRECISION: tl.constexpr):
    """Level ``i`` of the backward's rows (launched for i = L-1 .. 0, LEVEL0 = i == 0), on the forward's grid: one
    program = BLOCK_R rows of a chunk x one query head. From its rows' causal sums (``_bwd_sums_kernel``'s planes)
    it recomputes the level's weights as the forward does and takes the gradient back through them: the carries to
    level i - 1 are written, the chunk-start state's and the parameters' gradients added in (atomics), and what the
    query and key rows need (u, d_snum, d_n, d routed, the RSA-q weights' gradient) is written for
    ``_bwd_query_kernel`` and ``_bwd_keys_kernel``. The products with an (R, m) left operand read it back from those
    planes (or, for act, chain, d a and d a^, from one not yet written), a barrier after each store and before a
    plane is written again; so the tiles held are (R, K), (R, m), (K, m), (K, BLOCK) and m x m."""
    chunk, bh, bg, row0, rows, reach = _row_program(C, H, G, GS, BLOCK_R)
    head = bh % H
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK)
    slot_ok, row_ok = slots < M, (rows < C)[:, None]
    ok_rm, ok_mm = row_ok & slot_ok[None, :], slot_ok[:, None] & slot_ok[None, :]
    off_mm = slots[:, None] * M + slots[None, :]
    level_row = (bg * L + i) * Tp + row0
    state = (bg * NB + chunk) * L + i
    kappa_at = (bg % G) * L + i
    hl = head * L + i
    q_rows = bh * Tp + row0 + rows[:, None]  # (R, 1) rows of (B, H, Tp, .) tensors
    carry_at = q_rows * M + slots[None, :]
    plane_rows = ((bh * L + i) * Tp + row0 + rows[:, None]) * M  # (R, 1) rows of the (B, H, L, Tp, m) buffers
    plane_at = plane_rows + slots[None, :]
    g_stride = DV + LOG_WEIGHT  # g's rows carry the log weight's gradient as one more channel
    state_rows = (state * M + slots)[:, None]  # (m, 1) rows of the chunk-start sums KS0 (., d), VS0 (., dv)

    # The level's causal sums (``_bwd_sums_kernel``): N, the score numerator and d_read (d num = g / max(den, eps)
    # row by row), from the planes this program then overwrites with its own results
    n = tl.load(d_n_ptr + plane_at, mask=ok_rm, other=0.0)
    snum = tl.load(d_snum_ptr + plane_at, mask=ok_rm, other=0.0)
    d_read = tl.load(u_ptr + plane_at, mask=ok_rm, other=0.0)
    norm = tl.maximum(tl.load(den_ptr + bh * Tp + row0 + rows, mask=rows < C, other=0.0), eps)
    d_den = tl.load(d_den_ptr + bh * Tp + row0 + rows, mask=rows < C, other=0.0)  # the sums kernel's
    inv = 1.0 / norm

    d_chain = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)  # into chain_i, from level i + 1's routing
    dn_next = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)  # into N_i, from level i + 1's relation routing
    if ROUTING != 0:
        if i < L - 1:  # written by level i + 1; none above the top level
            d_chain = tl.load(d_chain_ptr + carry_at, mask=ok_rm, other=0.0)
            if ROUTING == 2:
                dn_next = tl.load(dn_next_ptr + carry_at, mask=ok_rm, other=0.0)
    kappa = tl.load(kappa_ptr + kappa_at)
    score, den_k, act = _activation(snum, kappa, n, slot_ok, tau, eps, LEVEL0, READOUT)
    theta_raw = tl.load(theta_ptr + hl)  # as learned: clamped here, its gradient passed where the clamp passes it
    theta = tl.minimum(tl.maximum(theta_raw, 0.0), theta_max)
    scale = tl.load(wa_ptr + hl)
    # Products with the m x m weights take their left operand back from memory, a block of slots at a time: held,
    # each weight tile was a dot operand in two layouts and the (R, m) operands every warp's. The d_n plane, free
    # until the end, carries act and d a^; the u and d_snum planes chain and d a (a barrier after each store, and
    # before a plane is written again).
    tl.store(d_n_ptr + plane_at, act, mask=ok_rm)
    tl.debug_barrier()
    a_hat = _row_products(d_n_ptr, plane_rows, row_ok, w_ptr + hl * M * M, slots[:, None], slot_ok[:, None], M, M,
                          BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)  # act W
    active = (a_hat > theta) & slot_ok[None, :]  # where the relu passes
    sparse = tl.where(slot_ok[None, :], scale * tl.maximum(a_hat - theta, 0.0) + theta / M, 0.0)

    # chain_i = routed . sparse: routed is the saved chain_{i-1} (elementwise routing) or, with relation routing,
    # c~ R0 + ((c~ F_{i-1}^T) . M) F_i from the sums kernel (in the d routed plane until d routed replaces it)
    routed = tl.full((BLOCK_R, BLOCK_M), 1.0, tl.float32)
    if not LEVEL0 and ROUTING != 0:
        chain_rows = ((bh * (L - 1) + i - 1) * Tp + row0 + rows[:, None]) * M  # (R, 1): chain_{i-1}'s rows
        chain_at = chain_rows + slots[None, :]
        if ROUTING == 1:
            routed = tl.load(chain_ptr + chain_at, mask=ok_rm, other=0.0)
        else:
            routed = tl.load(d_routed_ptr + plane_at, mask=ok_rm, other=0.0)
    chain = routed * sparse
    tl.store(u_ptr + plane_at, chain, mask=ok_rm)
    tl.debug_barrier()
    a = _row_products(u_ptr, plane_rows, row_ok, wr_ptr + hl * M * M, slots[:, None], slot_ok[:, None], M, M,
                      BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)  # chain W_r
    norm_n = tl.maximum(n, eps)
    mass_ok = n >= eps  # where clamp_min passes the gradient

    # num += read(a) = a~ VS0 + ((a~ F^T) . M) Y, a~ = a / max(N, eps): d a~ = d_read / max(den, eps)
    scaled = a / norm_n
    d_scaled = d_read * inv[:, None]
    sign = tl.where(a > 0, 1.0, tl.where(a < 0, -1.0, 0.0))
    d_a = d_scaled / norm_n + d_den[:, None] * sign  # den += sum |a_i|
    d_n = tl.where(mass_ok, -(d_scaled / norm_n) * scaled, 0.0) + dn_next
    u = scaled * inv[:, None]  # the read weights of d num: dVS0 = u^T g, dY = ((u F^T) . M)^T g
    if QUERY_READ:  # extra += read(q W_qr / 16), outside the normaliser: d extra = g
        q_wqr = _row_products(q_ptr, q_rows * D, row_ok, wqr_ptr + hl * D * M, slots[:, None], slot_ok[:, None], D,
                              M, BLOCK_R, BLOCK_M, BLOCK, PRECISION)  # W_qr (d, m) read as its transpose
        scaled_q = q_wqr / 16 / norm_n
        d_weights = d_read / norm_n  # d(q W_qr / 16), for the query kernel
        tl.store(d_query_ptr + plane_at, d_weights, mask=ok_rm)
        d_n += tl.where(mass_ok, -d_weights * scaled_q, 0.0)
        u += scaled_q
    tl.debug_barrier()
    tl.store(u_ptr + plane_at, u, mask=ok_rm)
    for v0 in range(0, DV, BLOCK):
        cv = v0 + cols
        g = tl.load(g_ptr + q_rows * g_stride + cv[None, :], mask=row_ok & (cv < DV)[None, :], other=0.0)
        tl.atomic_add(dvs0_ptr + state_rows * DV + cv[None, :], tl.dot(tl.trans(u), g, input_precision=PRECISION),
                      mask=slot_ok[:, None] & (cv < DV)[None, :])

    # a = chain W_r
    tl.store(d_snum_ptr + plane_at, d_a, mask=ok_rm)
    tl.debug_barrier()
    d_chain_i = d_chain + _row_products(d_snum_ptr, plane_rows, row_ok, wr_ptr + hl * M * M, slots[:, None] * M,
                                        slot_ok[:, None], M, 1, BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)  # d a W_r^T
    tl.atomic_add(dwr_ptr + hl * M * M + off_mm, tl.dot(tl.trans(chain), d_a, input_precision=WEIGHT_PRECISION),
                  mask=ok_mm)
    d_sparse = d_chain_i * routed
    d_chain = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)
    dn_next = tl.zeros((BLOCK_R, BLOCK_M), tl.float32)
    if not LEVEL0 and ROUTING == 1:
        d_chain = d_chain_i * sparse
    if not LEVEL0 and ROUTING == 2:
        d_routed = d_chain_i * sparse
        r0_at = ((bg * NB + chunk) * (L - 1) + i - 1) * M * M
        scaled_prev = tl.load(scaled_ptr + chain_at, mask=ok_rm, other=0.0)  # c~, from the routing kernel
        tl.atomic_add(dr0_ptr + r0_at + off_mm, tl.dot(tl.trans(scaled_prev), d_routed,
                                                         input_precision=WEIGHT_PRECISION), mask=ok_mm)
        tl.store(d_routed_ptr + plane_at, d_routed, mask=ok_rm)  # for the keys kernel, and read back below
        tl.debug_barrier()
        d_scaled_prev = _row_products(d_routed_ptr, plane_rows, row_ok, r0_ptr + r0_at, slots[:, None] * M,
                                      slot_ok[:, None], M, 1, BLOCK_R, BLOCK_M, BLOCK,
                                      WEIGHT_PRECISION)  # d routed R0^T
        for k0 in range(0, reach, BLOCK_K):
            cols_k = k0 + keys
            ok_km = (cols_k < reach)[:, None] & slot_ok[None, :]
            key_rows = level_row + cols_k[:, None]
            f_prev = tl.load(f_ptr + (key_rows - Tp) * M + slots[None, :], mask=ok_km, other=0.0)
            d_intra_prev = _row_products(d_routed_ptr, plane_rows, row_ok, f_ptr, key_rows * M,
                                         (cols_k < reach)[:, None], M, 1, BLOCK_R, BLOCK_K, BLOCK, WEIGHT_PRECISION)
            d_scaled_prev += tl.dot(d_intra_prev * (cols_k[None, :] <= rows[:, None]).to(tl.float32), f_prev,
                                    input_precision=WEIGHT_PRECISION)
        n_prev = tl.load(d_n_ptr + plane_at - Tp * M, mask=ok_rm, other=0.0)  # N_{i-1}: level i - 1's launch is
        d_chain = d_scaled_prev / tl.maximum(n_prev, eps)  # later, and its plane still holds the sums kernel's N
        dn_next = tl.where(n_prev >= eps, -d_chain * scaled_prev, 0.0)

    # sparse = w_a relu(act W - theta) + theta / m
    d_sparse = tl.where(ok_rm, d_sparse, 0.0)
    d_a_hat = tl.where(active, d_sparse * scale, 0.0)
    tl.atomic_add(dwa_ptr + hl, tl.sum(tl.sum(tl.where(active, d_sparse * (a_hat - theta), 0.0), 1), 0))
    clamp_passes = ((theta_raw >= 0.0) & (theta_raw <= theta_max)).to(tl.float32)
    tl.atomic_add(dtheta_ptr + hl, clamp_passes * tl.sum(tl.sum(d_sparse * (1.0 / M - tl.where(active, scale, 0.0)),
                                                                1), 0))
    tl.atomic_add(dw_ptr + hl * M * M + off_mm, tl.dot(tl.trans(act), d_a_hat, input_precision=WEIGHT_PRECISION),
                  mask=ok_mm)
    tl.store(d_n_ptr + plane_at, d_a_hat, mask=ok_rm)
    tl.debug_barrier()
    d_act = _row_products(d_n_ptr, plane_rows, row_ok, w_ptr + hl * M * M, slots[:, None] * M, slot_ok[:, None], M,
                          1, BLOCK_R, BLOCK_M, BLOCK, WEIGHT_PRECISION)  # d a^ W^T
    if READOUT == 1:
        d_score = act * (d_act - tl.sum(act * d_act, 1)[:, None])
        if LEVEL0:  # the count prior log max(N, eps)
            d_n += tl.where(mass_ok, d_score / norm_n, 0.0)
    else:
        d_score = d_act * act * (1.0 - act)
    d_score = tl.where(slot_ok[None, :], d_score, 0.0)
    if LOG_WEIGHT and LEVEL0:  # lw = log sum_j max(N_j, eps) exp(score_j): through p = softmax(score + log N)
        g_lw = tl.load(g_ptr + q_rows * g_stride + DV, mask=row_ok, other=0.0)  # (R, 1): the last channel
        z = tl.where(slot_ok[None, :], score + tl.log(norm_n), float("-inf"))
        p = tl.exp(z - tl.max(z, 1)[:, None])
        d_lw = g_lw * p / tl.sum(p, 1)[:, None]
        d_score += d_lw
        d_n += tl.where(mass_ok, d_lw / norm_n, 0.0)

    # score = tau (q KS0^T + ((q X^T) . M) F) / max(kappa + N, eps)
    d_snum = tau * d_score / den_k
    d_den_k = tl.where(kappa + n >= eps, -d_score * score / den_k, 0.0)
    d_n += d_den_k
    tl.atomic_add(dkappa_ptr + kappa_at, tl.sum(tl.sum(d_den_k, 1), 0))
    tl.store(d_snum_ptr + plane_at, d_snum, mask=ok_rm)  # for the query and keys kernels

    # N = n0 + M F
    d_n = tl.where(row_ok, d_n, 0.0)
    tl.store(d_n_ptr + plane_at, d_n, mask=ok_rm)
    tl.atomic_add(dn0_ptr + state * M + slots, tl.sum(d_n, 0), mask=slot_ok)
    if not LEVEL0 and ROUTING != 0:  # for level i - 1 (the same rows' program: no other program reads them)
        tl.store(d_chain_ptr + carry_at, d_chain, mask=ok_rm)
        if ROUTING == 2:
            tl.store(dn_next_ptr + carry_at, dn_next, mask=ok_rm)


@triton.jit(do_not_specialize=["Tp", "NB"])
def _bwd_query_kernel(q_ptr, f_ptr, x_ptr, ks0_ptr, wqr_ptr, d_snum_ptr, d_query_ptr, dq_ptr, dks0_ptr, dwqr_ptr,
                      Tp, NB, H, G, GS, C, M, D,
                      L: tl.constexpr, QUERY_READ: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                      WEIGHT_PRECISION: tl.constexpr):
    """The query side's gradients of BLOCK_R rows of a chunk x one query head, every level's at once (after the
    level kernels, from the d_snum [and RSA-q weight gradient] planes they wrote), a block of d at a time:
    dq = sum_i d_snum_i KS0_i + ((d_snum_i F_i^T) . M) X_i [+ d_query_i W_qr_i^T / 16], stored once; the
    chunk-start sums' dKS0_i += d_snum_i^T q [and dW_qr_i += q^T d_query_i / 16] added in (atomics)."""
    chunk, bh, bg, row0, rows, reach = _row_program(C, H, G, GS, BLOCK_R)
    head = bh % H
    keys = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK)
    slot_ok, row_ok = slots < M, (rows < C)[:, None]
    ok_rm = row_ok & slot_ok[None, :]
    q_rows = bh * Tp + row0 + rows[:, None]  # (R, 1) rows of (B, H, Tp, .) tensors
    for d0 in range(0, D, BLOCK):
        cd = d0 + cols
        ok_rd, ok_md = row_ok & (cd < D)[None, :], slot_ok[:, None] & (cd < D)[None, :]
        q = tl.load(q_ptr + q_rows * D + cd[None, :], mask=ok_rd, other=0.0)
        dq = tl.zeros((BLOCK_R, BLOCK), tl.float32)
        for i in range(L):
            level_row = (bg * L + i) * Tp + row0
            state = (bg * NB + chunk) * L + i
            plane_rows = ((bh * L + i) * Tp + row0 + rows[:, None]) * M  # (R, 1) rows of the (B, H, L, Tp, m) planes
            dq += _row_products(d_snum_ptr, plane_rows, row_ok, ks0_ptr, state * M * D + cd[:, None],
                                (cd < D)[:, None], M, D, BLOCK_R, BLOCK, BLOCK, WEIGHT_PRECISION)  # d_snum KS0
            for k0 in range(0, reach, BLOCK_K):  # ((d_snum F^T) . M) X
                cols_k = k0 + keys
                key_ok = (cols_k < reach)[:, None]
                key_rows = level_row + cols_k[:, None]
                x = tl.load(x_ptr + key_rows * D + cd[None, :], mask=key_ok & (cd < D)[None, :], other=0.0)
                d_qx = _row_products(d_snum_ptr, plane_rows, row_ok, f_ptr, key_rows * M, key_ok, M, 1,
                                     BLOCK_R, BLOCK_K, BLOCK, WEIGHT_PRECISION)
                dq += tl.dot(d_qx * (cols_k[None, :] <= rows[:, None]).to(tl.float32), x,
                             input_precision=WEIGHT_PRECISION)
            d_snum = tl.load(d_snum_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
            tl.atomic_add(dks0_ptr + (state * M + slots)[:, None] * D + cd[None, :],
                          tl.dot(tl.trans(d_snum), q, input_precision=WEIGHT_PRECISION), mask=ok_md)
            if QUERY_READ:
                hl = head * L + i
                ok_dm = (cd < D)[:, None] & slot_ok[None, :]
                d_weights = tl.load(d_query_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
                wqr = tl.load(wqr_ptr + hl * D * M + cd[:, None] * M + slots[None, :], mask=ok_dm, other=0.0)
                dq += tl.dot(d_weights, tl.trans(wqr), input_precision=PRECISION) / 16
                tl.atomic_add(dwqr_ptr + hl * D * M + cd[:, None] * M + slots[None, :],
                              tl.dot(tl.trans(q), d_weights, input_precision=PRECISION) / 16, mask=ok_dm)
        tl.store(dq_ptr + q_rows * D + cd[None, :], dq, mask=ok_rd)


@triton.jit(do_not_specialize=["Tp", "NB"])
def _bwd_keys_kernel(q_ptr, f_ptr, x_ptr, y_ptr, g_ptr, scaled_prev_ptr, u_ptr, d_snum_ptr, d_n_ptr, d_routed_ptr,
                     df_ptr, dx_ptr, dy_ptr,
                     Tp, NB, H, G, GS, C, M, D, DV,
                     L: tl.constexpr, ROUTING: tl.constexpr, LOG_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """The gradients of the chunk's key-side rows F_i, X_i, Y_i, from what ``_bwd_level_kernel`` wrote for every level:
    one program = BLOCK_K rows of a chunk x one KV head x one level, summing over its query heads and the rows that
    read them (rows >= its keys), BLOCK_R at a time; it owns its rows' gradients (stored, no atomics). With u the
    read weights, d_snum the score numerator's gradient, d_n the mass's, and (relation routing) d routed / c~:
      dF_i = ((g Y_i^T) . M)^T u + ((q X_i^T) . M)^T d_snum + M^T d_n
             [+ ((c~_i F_{i-1}^T) . M)^T d routed_i + ((d routed_{i+1} F_{i+1}^T) . M)^T c~_{i+1}]
      dX_i = ((d_snum F_i^T) . M)^T q,   dY_i = ((u F_i^T) . M)^T g
    Every (R, K) product is summed over BLOCK features or slots at a time (``_row_products``)."""
    key_blocks = tl.cdiv(C, BLOCK_K)
    chunk = (tl.program_id(0) // key_blocks).to(tl.int64)
    bg = tl.program_id(1).to(tl.int64)  # b * G + KV head
    i = tl.program_id(2)
    first = (tl.program_id(0) % key_blocks) * BLOCK_K
    keys = first + tl.arange(0, BLOCK_K)
    slots = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK)
    key_ok, slot_ok = (keys < C)[:, None], slots < M
    key_rows = (bg * L + i) * Tp + chunk * C + keys[:, None]  # (K, 1) rows of the (B, G, L, Tp, .) level tensors
    row_start = first - first % BLOCK_R  # the rows that read these keys: [row_start, C)
    g_stride = DV + LOG_WEIGHT  # g's rows carry the log weight's gradient as one more channel
    d_f = tl.zeros((BLOCK_K, BLOCK_M), tl.float32)
    for j in range(GS):
        bh = (bg // G) * H + (bg % G) * GS + j  # the group's query heads
        for r0 in range(row_start, C, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_ok = (rows < C)[:, None]
            ok_rm = row_ok & slot_ok[None, :]
            causal = ((keys[None, :] <= rows[:, None]) & key_ok.trans()).to(tl.float32)  # (R, K)
            q_rows = bh * Tp + chunk * C + rows[:, None]  # (R, 1) rows of (B, H, Tp, .) tensors
            plane_rows = ((bh * L + i) * Tp + chunk * C + rows[:, None]) * M  # of the (B, H, L, Tp, m) buffers
            g_y = _row_products(g_ptr, q_rows * g_stride, row_ok, y_ptr, key_rows * DV, key_ok, DV, 1, BLOCK_R,
                                BLOCK_K, BLOCK, PRECISION) * causal
            q_x = _row_products(q_ptr, q_rows * D, row_ok, x_ptr, key_rows * D, key_ok, D, 1, BLOCK_R, BLOCK_K,
                                BLOCK, PRECISION) * causal
            u = tl.load(u_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
            d_snum = tl.load(d_snum_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
            d_n = tl.load(d_n_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
            d_f += tl.dot(tl.trans(g_y), u, input_precision=PRECISION) \
                + tl.dot(tl.trans(q_x), d_snum, input_precision=PRECISION) \
                + tl.dot(tl.trans(causal), d_n, input_precision=PRECISION)
            if ROUTING == 2:  # routed_i = c~_i R0 + ((c~_i F_{i-1}^T) . M) F_i, c~_i = chain_{i-1} / N_{i-1}
                chain_rows = ((bh * (L - 1) + i) * Tp + chunk * C + rows[:, None]) * M  # chain_i's (c~_{i+1})
                if i > 0:
                    intra_prev = _row_products(scaled_prev_ptr, chain_rows - Tp * M, row_ok, f_ptr,
                                               (key_rows - Tp) * M, key_ok, M, 1, BLOCK_R, BLOCK_K, BLOCK, PRECISION)
                    d_routed = tl.load(d_routed_ptr + plane_rows + slots[None, :], mask=ok_rm, other=0.0)
                    d_f += tl.dot(tl.trans(intra_prev * causal), d_routed, input_precision=PRECISION)
                if i < L - 1:  # F_i as level i + 1's F_{i-1}
                    d_intra = _row_products(d_routed_ptr, plane_rows + Tp * M, row_ok, f_ptr, (key_rows + Tp) * M,
                                            key_ok, M, 1, BLOCK_R, BLOCK_K, BLOCK, PRECISION)
                    scaled_next = tl.load(scaled_prev_ptr + chain_rows + slots[None, :], mask=ok_rm, other=0.0)
                    d_f += tl.dot(tl.trans(d_intra * causal), scaled_next, input_precision=PRECISION)
    tl.store(df_ptr + key_rows * M + slots[None, :], d_f, mask=key_ok & slot_ok[None, :])
    # dX, dY: a block of features at a time, each summed over the query heads and rows
    key_side_blocks = tl.cdiv(D, BLOCK)
    for block in range(key_side_blocks + tl.cdiv(DV, BLOCK)):  # X's blocks of d, then Y's of dv
        value_side = block >= key_side_blocks
        cd = (block - key_side_blocks * value_side) * BLOCK + cols
        width = tl.where(value_side, DV, D)
        acc = tl.zeros((BLOCK_K, BLOCK), tl.float32)
        for j in range(GS):
            bh = (bg // G) * H + (bg % G) * GS + j
            for r0 in range(row_start, C, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                row_ok = (rows < C)[:, None]
                causal = ((keys[None, :] <= rows[:, None]) & key_ok.trans()).to(tl.float32)
                q_rows = bh * Tp + chunk * C + rows[:, None]
                plane_rows = ((bh * L + i) * Tp + chunk * C + rows[:, None]) * M
                ok_rd = row_ok & (cd < width)[None, :]
                if value_side:  # dY = ((u F^T) . M)^T g
                    weights_ptr = u_ptr
                    rhs = tl.load(g_ptr + q_rows * g_stride + cd[None, :], mask=ok_rd, other=0.0)
                else:  # dX = ((d_snum F^T) . M)^T q
                    weights_ptr = d_snum_ptr
                    rhs = tl.load(q_ptr + q_rows * D + cd[None, :], mask=ok_rd, other=0.0).to(tl.float32)
                w_keys = _row_products(weights_ptr, plane_rows, row_ok, f_ptr, key_rows * M, key_ok, M, 1, BLOCK_R,
                                       BLOCK_K, BLOCK, PRECISION) * causal
                acc += tl.dot(tl.trans(w_keys), rhs, input_precision=PRECISION)
        ok_kd = key_ok & (cd < width)[None, :]
        if value_side:
            tl.store(dy_ptr + key_rows * DV + cd[None, :], acc, mask=ok_kd)
        else:
            tl.store(dx_ptr + key_rows * D + cd[None, :], acc, mask=ok_kd)


# ----------------------------------------------------------------------------------------------------------------
# Launchers and the autograd wrapper.


def _read_options(params: RSAParams, weight_precision: str = READ_PRECISION) -> tuple:
    """What the read kernels take besides tensors, as plain values (the ops' arguments): from ``params`` the chunk
    size, eps, theta's upper clamp, readout, routing, whether the RSA-q branch is on, whether the log weight is
    appended; and the read weights' dot precision (``WEIGHT_PRECISION``: the caller's ``conventions.dot_precision``)."""
    return (params.chunk_size, float(params.eps), float(params.threshold_max), params.readout, params.routing,
            params.query_read is not None, bool(params.log_weight), weight_precision)


def _launch_options(kernel, options: dict, **extra) -> dict:
    """The launch keywords of ``kernel``: those of ``options`` it declares (its constexprs) and the launch's warps
    and stages, with ``extra`` over them."""
    return {**{key: value for key, value in options.items() if key in kernel.arg_names or key.startswith("num_")},
            **extra}


class _Read:
    """Static launch arguments of one call: sizes, options and block sizes (``options``: ``_read_options``;
    ``boundaries``: the sums' rows per sequence and KV head, NC or NC + 1, the memory section above)."""

    def __init__(self, options: tuple, q, f, y, boundaries: int | None = None):
        chunk_size, eps, threshold_max, readout, routing, query_read, log_weight, weight_precision = options
        batch, heads, self.padded, key_dim = q.shape
        _, groups, levels, _, slots = f.shape
        n_chunks = self.padded // chunk_size
        self.grid = (n_chunks * triton.cdiv(chunk_size, PROGRAM_ROWS), batch * heads)  # forward and backward
        self.sizes = (self.padded, n_chunks if boundaries is None else boundaries, heads, groups, heads // groups,
                      chunk_size, slots, key_dim, y.shape[-1], key_dim**-0.5, eps, threshold_max)
        self.batch, self.heads, self.levels, self.slots, self.value_dim = batch, heads, levels, slots, y.shape[-1]
        self.options = dict(L=levels, READOUT=READOUTS[readout], ROUTING=ROUTINGS[routing],
                            QUERY_READ=query_read, LOG_WEIGHT=log_weight, BLOCK_M=tile_edge(slots),
                            BLOCK_R=PROGRAM_ROWS, BLOCK_K=KEY_BLOCK, PRECISION=READ_PRECISION,
                            WEIGHT_PRECISION=weight_precision, num_warps=READ_WARPS, num_stages=READ_STAGES)
        self.weights_options = _launch_options(_weights_kernel, self.options,
                                               BLOCK_D=min(tile_edge(key_dim), FEATURE_BLOCK), BLOCK_S=FEATURE_BLOCK)
        self.values_options = _launch_options(_values_kernel, self.options, BLOCK_S=FEATURE_BLOCK,
                                              BLOCK_DV=min(tile_edge(y.shape[-1]), VALUE_BLOCK),
                                              BLOCK_G=triton.next_power_of_2(heads // groups))
        # a KV head's query heads in one program, VALUE_BLOCK value features of theirs
        self.values_grid = (self.grid[0], batch * groups, triton.cdiv(y.shape[-1], self.values_options["BLOCK_DV"]))
        self.values_sizes = (*self.sizes[:7], y.shape[-1], eps)  # Tp ... M, DV, eps
        self.sums_grid = (*self.grid, levels)
        self.sums_options = _launch_options(_bwd_sums_kernel, self.options, BLOCK=FEATURE_BLOCK)
        # with relation routing, levels 1 .. L-1's routed chains (an empty grid otherwise)
        self.routing_grid = (*self.grid, (levels - 1) * (self.options["ROUTING"] == 2))
        self.routing_sizes = (*self.sizes[:7], eps)  # Tp ... M, eps
        self.routing_options = _launch_options(_bwd_routing_kernel, self.options, BLOCK=FEATURE_BLOCK)
        self.backward_options = _launch_options(_bwd_level_kernel, self.options, BLOCK=FEATURE_BLOCK)
        self.query_options = _launch_options(_bwd_query_kernel, self.options, BLOCK=FEATURE_BLOCK)
        self.keys_grid = (n_chunks * triton.cdiv(chunk_size, KEY_BLOCK), batch * groups, levels)
        self.keys_options = _launch_options(_bwd_keys_kernel, self.options, BLOCK=FEATURE_BLOCK,
                                            PRECISION=KEYS_PRECISION, num_warps=KEYS_WARPS)

    def scratch(self, like: torch.Tensor) -> tuple[list, torch.Tensor, list, torch.Tensor]:
        """The backward's buffers, fp32, as views of one allocation: the (B, H, L, Tp, m) planes the level kernels
        hand on -- u, d_snum, d_n (first the causal sums the level kernel starts from), with relation routing d
        routed, with RSA-q the query weights' gradient --, c~ (B, H, L-1, Tp, m) with relation routing, the two
        carries (d chain, d N) from level i + 1 to level i (B, H, Tp, m) with routing, and the normaliser's gradient
        (B, H, Tp); ``like`` stands in for those the options do not use. Returns (the 5 planes, c~, the 2 carries,
        d den)."""
        plane = (self.batch, self.heads, self.levels, self.padded, self.slots)
        relation, query = self.options["ROUTING"] == 2, self.options["QUERY_READ"]
        routed = self.levels > 1 and self.options["ROUTING"] != 0
        shapes = [plane] * (3 + relation + query) \
            + [(self.batch, self.heads, self.levels - 1, *plane[3:])] * relation \
            + [(self.batch, self.heads, self.padded, self.slots)] * (2 * routed) \
            + [(self.batch, self.heads, self.padded)]
        buffers = iter(unpacked(like.new_empty(sum(math.prod(shape) for shape in shapes)), shapes))
        planes = [next(buffers) for _ in range(3)] + [next(buffers) if used else like for used in (relation, query)]
        scaled = next(buffers) if relation else like
        carries = [next(buffers), next(buffers)] if routed else [like] * 2
        return planes, scaled, carries, next(buffers)

    def warmups(self, inputs, backward: bool) -> list:
        """The launches of this call as ``(kernel, grid, args, constexprs)`` for ``JITFunction.warmup``: the forward,
        and for a backward the level-0 variant and the other levels' one (the level is not specialised). Buffers not
        yet allocated are given as their dtype (all fp32)."""
        fp32 = torch.float32  # weights, query weights, c~, log weight, chain, den; f, y, vs0, ..., out, num
        warmups = [(_weights_kernel, self.grid, (*inputs, *[fp32] * 6, *self.sizes, 0), self.weights_options),
                   (_values_kernel, self.values_grid,
                    (inputs[1], inputs[3], inputs[5], *[fp32] * 5, *self.values_sizes, 0), self.values_options)]
        if backward:  # the sums, the levels' (level 0's variant and the others'), the query side, the keys
            sums_args = (*inputs[:7], *[fp32] * 7, *self.sizes[:9], self.sizes[10])  # g, num, den, 3 planes, d den
            warmups.append((_bwd_sums_kernel, self.sums_grid, sums_args, self.sums_options))
            if self.routing_grid[2]:  # f, R0; chain, N, routed, c~
                warmups.append((_bwd_routing_kernel, self.routing_grid, (inputs[1], inputs[7], *[fp32] * 4,
                                                                         *self.routing_sizes), self.routing_options))
            # g, chain, c~, den, d den, the 2 carries, 5 planes and 8 gradients, the sizes and the level
            args = (*inputs, *[fp32] * (5 + 2 + 5 + 8), *self.sizes)
            warmups += [(_bwd_level_kernel, self.grid, (*args, level),
                         {**self.backward_options, "LEVEL0": level == 0}) for level in sorted({0, self.levels - 1})]
            query_args = (inputs[0], inputs[1], inputs[2], inputs[4], inputs[13], *[fp32] * 5, *self.sizes[:8])
            warmups.append((_bwd_query_kernel, self.grid, query_args, self.query_options))
            keys_args = (*inputs[:4], *[fp32] * (6 + 3), *self.sizes[:9])  # g, c~, 4 planes, dF, dX, dY
            warmups.append((_bwd_keys_kernel, self.keys_grid, keys_args, self.keys_options))
        return warmups

    def compile_kernels(self, inputs, backward: bool) -> None:
        """Compile what this call launches side by side, once per layout (kernels/triton_compile.py)."""
        if inputs[0].device.type == "cuda":  # the interpreter compiles nothing
            key = ("rsa", inputs[0].device, tuple(sorted(self.options.items())), self.sizes[2:9], backward)
            compile_side_by_side("RSA chunk read", key, lambda: self.warmups(inputs, backward))

    def saved_shapes(self, save: bool) -> list:
        """What the forward saves for its backward (``save``): chain_i (B, H, L-1, Tp, m), read back only by the
        routing, the numerator (B, H, Tp, dv) and the normaliser (B, H, Tp); (0,) for each one not saved."""
        chained = save and self.levels > 1 and self.options["ROUTING"] != 0
        return [(self.batch, self.heads, self.levels - 1, self.padded, self.slots) if chained else (0,),
                (self.batch, self.heads, self.padded, self.value_dim) if save else (0,),
                (self.batch, self.heads, self.padded) if save else (0,)]

    def forward(self, inputs, save: bool):
        """``inputs``: the 14 kernel tensors (q ... wqr). Returns out (B, H, Tp, dv [+ 1: the log weight]) fp32 and
        what ``saved_shapes`` names (0-size, not aliases of out, where not saved: an op's outputs are its own)."""
        q = inputs[0]
        out = q.new_empty(self.batch, self.heads, self.padded, self.value_dim, dtype=torch.float32)
        log_weight = out.new_empty(out.shape[:-1]) if self.options["LOG_WEIGHT"] else out  # else a dummy
        chain, num, den = (out.new_empty(shape) for shape in self.saved_shapes(save))
        if out.numel():  # the read weights, then the values they read (transient planes, fp32)
            plane = (self.batch, self.heads, self.levels, self.padded, self.slots)
            weights = out.new_empty(plane)
            query = out.new_empty(plane) if self.options["QUERY_READ"] else out
            relation = self.options["ROUTING"] == 2 and self.levels > 1
            scaled = out.new_empty(self.batch, self.heads, self.padded, self.slots) if relation else out
            normaliser = den if save else out.new_empty(out.shape[:-1])  # returned only when saved
            _weights_kernel[self.grid](*inputs, weights, query, scaled, log_weight, chain, normaliser, *self.sizes,
                                       int(save), **self.weights_options)
            _values_kernel[self.values_grid](inputs[1], inputs[3], inputs[5], weights, query, normaliser, out, num,
                                             *self.values_sizes, int(save), **self.values_options)
        if self.options["LOG_WEIGHT"]:
            out = torch.cat([out, log_weight[..., None]], -1)
        return out, chain, num, den

    def backward(self, inputs, grad_out, chain, num, den):
        """The gradients (fp32) of the 14 kernel inputs for dL/d(forward's output), from what the forward saved
        (``forward(save=True)``: chains, num, den), packed in one buffer (``unpacked(buffer, [t.shape for t in
        inputs])``): the kernels accumulate into them, so one zero fill."""
        packed, grads = packed_zeros([t.shape for t in inputs], inputs[0].device)
        if not grad_out.numel():
            return packed
        g = grad_out.float().contiguous()  # (B, H, Tp, dv [+ 1]): the kernels read the log weight's channel in place
        planes, scaled, carries, d_den = self.scratch(g)
        u, d_snum, d_n = planes[:3]
        _bwd_sums_kernel[self.sums_grid](*inputs[:7], g, num, den, d_n, d_snum, u, d_den, *self.sizes[:9],
                                         self.sizes[10], **self.sums_options)
        if self.routing_grid[2]:
            _bwd_routing_kernel[self.routing_grid](inputs[1], inputs[7], chain, d_n, planes[3], scaled,
                                                   *self.routing_sizes, **self.routing_options)
        for level in reversed(range(self.levels)):  # one launch per level, the top one first
            _bwd_level_kernel[self.grid](*inputs, g, chain, scaled, den, d_den, *carries, *planes, *grads[5:13],
                                         *self.sizes, level, LEVEL0=level == 0, **self.backward_options)
        _bwd_query_kernel[self.grid](inputs[0], inputs[1], inputs[2], inputs[4], inputs[13], d_snum, planes[4],
                                     grads[0], grads[4], grads[13], *self.sizes[:8], **self.query_options)
        _bwd_keys_kernel[self.keys_grid](*inputs[:4], g, scaled, *planes[:4], *grads[1:4], *self.sizes[:9],
                                         **self.keys_options)
        return packed


def _kernel_inputs(q_b, f, x, y, ks0, vs0, n0, r0, params: RSAParams, groups):
    """The 14 tensors the kernels read, contiguous and fp32 (q too: one compiled kernel for every input dtype), in
    kernel argument order."""
    fp32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    query_read = params.query_read if params.query_read is not None else params.threshold  # dummy pointer
    batch, _, group_size, padded, key_dim = q_b.shape
    return (fp32(q_b.reshape(batch, groups * group_size, padded, key_dim)), fp32(f), fp32(x), fp32(y),
            fp32(ks0), fp32(vs0), fp32(n0), fp32(r0), fp32(params.kappa), fp32(params.read_proj),
            fp32(params.mix_proj), fp32(params.threshold), fp32(params.read_scale), fp32(query_read))


# The read as torch.library ops, forward and backward: torch.compile keeps each as one opaque call in its graph (it
# never traces a launch), so a block's training step stays one graph and can be captured as a CUDA graph.


@kernel_op(__name__, "read_forward")
def _read_forward(inputs: list[torch.Tensor], chunk_size: int, eps: float, threshold_max: float, readout: str,
                  routing: str, query_read: bool, log_weight: bool, weight_precision: str,
                  backward: bool) -> list[torch.Tensor]:
    """[out (B, H, Tp, dv [+ 1]) fp32, chains, num, den] from the 14 kernel inputs (``_Read.forward``);
    ``backward``: a backward follows (the three saved for it, its kernels compiled side by side with the
    forward's)."""
    options = (chunk_size, eps, threshold_max, readout, routing, query_read, log_weight, weight_precision)
    read = _Read(options, inputs[0], inputs[1], inputs[3], inputs[4].shape[2])
    read.compile_kernels(inputs, backward)
    return list(read.forward(inputs, save=backward))


@_read_forward.register_fake
def _(inputs, chunk_size, eps, threshold_max, readout, routing, query_read, log_weight, weight_precision, backward):
    q, y = inputs[0], inputs[3]
    options = (chunk_size, eps, threshold_max, readout, routing, query_read, log_weight, weight_precision)
    read = _Read(options, q, inputs[1], y, inputs[4].shape[2])
    return [q.new_empty(*q.shape[:3], y.shape[-1] + log_weight, dtype=torch.float32),
            *(q.new_empty(shape, dtype=torch.float32) for shape in read.saved_shapes(backward))]


@kernel_op(__name__, "read_backward")
def _read_backward(inputs: list[torch.Tensor], grad_out: torch.Tensor, saved: list[torch.Tensor], chunk_size: int,
                   eps: float, threshold_max: float, readout: str, routing: str, query_read: bool, log_weight: bool,
                   weight_precision: str) -> torch.Tensor:
    """The 14 inputs' gradients (fp32), packed (``_Read.backward``: the sums, [routing,] level, query and keys
    kernels), from what the forward saved (chains, num, den)."""
    options = (chunk_size, eps, threshold_max, readout, routing, query_read, log_weight, weight_precision)
    read = _Read(options, inputs[0], inputs[1], inputs[3], inputs[4].shape[2])
    return read.backward(inputs, grad_out, *saved)


@_read_backward.register_fake
def _(inputs, grad_out, saved, chunk_size, eps, threshold_max, readout, routing, query_read, log_weight,
      weight_precision):
    return packed_zeros([t.shape for t in inputs], grad_out.device)[0]


def _save_read_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[0], *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # (the saved outputs' gradients, never defined, stay None: no zero fill)
    ctx.options = inputs[1:9]


def _read_gradients(ctx, grads):
    *inputs, chain, num, den = ctx.saved_tensors
    grads = unpacked(_read_backward(inputs, grads[0], [chain, num, den], *ctx.options), [t.shape for t in inputs])
    query_read = ctx.options[5]
    grads = [grad.to(t.dtype) for grad, t in zip(grads, inputs)]
    if not query_read:
        grads[-1] = None  # the dummy pointer
    return grads, None, None, None, None, None, None, None, None, None


_read_forward.register_autograd(_read_gradients, setup_context=_save_read_inputs)


# ----------------------------------------------------------------------------------------------------------------
# The chunked memory on top of the kernels.


def rsa_chunked_triton(q, k, v, valid, state: RSAState, params: RSAParams, log_decay=None, fresh: bool = False,
                       precision: str = FP32_DOTS):
    """Triton version of ``rsa_chunked``: same arguments, semantics and return values.

    q (B, G, g, T, d), k (B, G, T, d), v (B, G, T, dv), valid (B, T) bool or None -> o (B, G, g, T, dv) fp32 (zero
    at padded positions) and the new state. q, k, v may be fp32, fp16 or bf16 (computed in fp32, like
    ``rsa_memory``'s cast); gradients reach q, k, v, every tensor of ``params`` and of the incoming ``state``.
    Raises NotImplementedError with ``rsa_chunk_triton_supports``' reason for anything outside its scope.
    ``params.recompute`` is not needed: the read side is recomputed by the backward kernel anyway. ``precision``:
    the write's dot operands (``conventions.dot_precision`` of the caller's inputs before their cast to fp32: tf32
    for bf16 / fp16), and so the read's weights' (scores, slot mixing, routing); the read's sums (masses, values)
    always READ_PRECISION.
    """
    reason = rsa_chunk_triton_supports(params, q, v, log_decay)
    if reason is not None:
        raise NotImplementedError(f"rsa_chunked_triton: {reason}")
    batch, groups, group_size, length, key_dim = q.shape
    size = params.chunk_size
    cd = compute_dtype(q.dtype)  # fp32 here
    k, v = k.to(cd), v.to(cd)
    # the buffer of rsa_chunked: chunk boundaries at multiples of C
    layout = ChunkLayout.of(valid, state.count, size, length, fresh)
    if not layout.padded:
        return q.new_zeros(batch, groups, group_size, length, v.shape[-1] + params.log_weight, dtype=cd), state
    q_b, k_b, v_b = layout.pack(q, 3), layout.pack(k, 2), layout.pack(v, 2)
    valid_b = layout.valid(batch, q.device)
    # Write side: each level's assignment chain in one launch (kernels/rsa_chain_triton.py), the rest over all chunks
    priors = slot_prior(params, cd)  # kappa P and kappa: the write's references and the read's sums add them
    writes, state = write_chunks(k_b, v_b, valid_b, layout, state, params,
                                 chain=functools.partial(assign_chain_triton, precision=precision),
                                 level=functools.partial(level_writes_triton, precision=precision),
                                 mlps=functools.partial(residual_mlps_triton, precision=precision), priors=priors)

    # Read side: all chunks in one launch, from the chunk-start sums (taken whole, at every boundary where the write
    # kept them so: no copy of the starts; the compiled write's are the starts alone)
    levels = params.prototypes.shape[1]
    key_sum, value_sum, mass, relation_sum = writes.every_boundary or (
        writes.key_sum, writes.value_sum, writes.mass, writes.relation_sum)
    ks0 = priors[0][:, :, None] + key_sum  # kappa P + sums: (B, G, NB, L, m, d)
    r0 = relation_sum if levels > 1 else mass.new_zeros(1)  # (B, G, NB, L-1, m, m)
    f, x, y = writes.f, writes.x, writes.y  # (B, G, L, Tp, m | d | dv)
    inputs = _kernel_inputs(q_b, f, x, y, ks0, value_sum, mass, r0, params, groups)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    out_b = _read_forward(list(inputs), *_read_options(params, precision), backward)[0]
    out_b = out_b.unflatten(1, (groups, group_size))  # (B, G, g, Tp, dv)

    return layout.unpack(out_b, length), state
