"""The RSA memory's write side in one Triton launch per call, for inference (prefill, conversion, evaluation).

Same function as ``rsa_state.write_chunks`` (which holds the math): every chunk of the aligned buffer, in order,
assigns its rows against the references of the last boundary, level by level (each level writes the residual MLP of
the one above), adds its writes to the sums, and refreshes the references at each boundary its tokens reach.

Why a kernel: the chunks are sequential (a chunk's assignments read the references its predecessors refreshed), and
eagerly each chunk is ~150 small operator calls (4 levels of an assignment, two residuals, two MLPs and the sums).
On a GPU each call is a kernel launch: a 16K-token prefill of the converted SmolLM2 (256 chunks x 30 layers) took
63 s on an H100 (docs/benchmarks.md, "The fourth GPU run"), the teacher 3 s. Here one program per (batch row, KV
head) walks every chunk of the call; the state it updates stays in global memory (its tiles, m x d per level, are
too many for registers) and is re-read after a barrier.

Inference only: no backward (training keeps the PyTorch write side, which autograd differentiates; on a GPU
``rsa_compile_write`` fuses it instead). Scope (``write_triton_supports``): no decay, the residual MLPs as
``ResidualMLPWeights``, head dims and MLP widths up to MAX_HEAD_DIM, chunks and slots up to MAX_TILE; fp32 (the
memory's compute dtype). Ragged sizes are padded to power-of-two tiles and masked.

GPU status: tested under the interpreter (against ``write_chunks``) and compiled for sm_90 with Triton 3.6 on a CPU
(``scripts/kernel_resources.py``): 112 KiB of shared memory at SmolLM2's 64-wide heads (7 s to compile), 192 KiB
at Llama-3-8B's 128-wide ones (45 s), of the 227 KiB an H100 block may have. The levels are a loop, not unrolled:
unrolled, the 128-wide kernel took 256 s to compile. Speed on a GPU is unmeasured.
"""

from __future__ import annotations

from dataclasses import replace

import torch

# A try block on purpose (see rsa_chunk_triton.py): imported only once a Triton path was chosen.
try:
    import triton
    import triton.language as tl
finally:
    pass

from .common import tile_edge
from .rsa_state import ChunkLayout, ChunkWrites, ResidualMLPWeights, RSAParams, RSAState
from .triton_compile import compile_side_by_side

# fp32-accurate dots on tensor cores: plain tf32 would put the read ~1e-3 off the reference (it divides sums by
# masses and chains levels); "ieee" (FMA dots) is exact too, but at the default sizes the read's backward did not
# finish compiling in 25 CPU-minutes, and tf32's needs more shared memory than an H100 has (rsa_chunk_triton.py).
INPUT_PRECISION = "tf32x3"
NUM_WARPS = 4  # untuned (needs a GPU)
MAX_TILE = 64  # chunk size and slots: one tile (C x m, m x m)
MAX_HEAD_DIM = 128  # key / value head dims and MLP widths (Llama-3-8B's heads): (C, d) and (h, d) tiles whole


def scope_reason(params: RSAParams, v=None, log_decay=None, widths=()) -> str | None:
    """Why the RSA Triton kernels (this write, the chunk read) cannot take this call as far as their shared scope goes
    -- decay, the assignment function, tile sizes (``widths``: further (name, size) held as (h, d) tiles) -- or None."""
    if log_decay is not None:
        return "GLA-style decay (log_decay / rsa_decay=True) is not implemented in the Triton RSA kernels"
    if params.assign_fn not in ("softmax", "sigmoid"):
        return f"unknown assign_fn {params.assign_fn!r}"
    _, _, slots, key_dim = params.prototypes.shape
    sizes = [("chunk_size", params.chunk_size, MAX_TILE), ("slots", slots, MAX_TILE),
             ("key head dim", key_dim, MAX_HEAD_DIM)]
    sizes += [("value head dim", v.shape[-1], MAX_HEAD_DIM)] if v is not None else []
    sizes += [(name, size, MAX_HEAD_DIM) for name, size in widths]
    for name, size, limit in sizes:
        if size > limit:
            return (f"{name} {size} > {limit}: one program holds whole tiles of it, and wider ones need more shared "
                    f"memory than a GPU block has")
    return None


def write_triton_supports(params: RSAParams, v=None, log_decay=None) -> str | None:
    """None when ``write_chunks_triton`` can run this call, else the reason."""
    mlps = (*params.key_mlps, *params.value_mlps)
    if not all(isinstance(mlp, ResidualMLPWeights) for mlp in mlps):
        return "the residual MLPs are not ResidualMLPWeights"
    widths = [("MLP width", max(mlp.up_weight.shape[0] for mlp in mlps))] if mlps else []
    return scope_reason(params, v, log_decay, widths)


@triton.jit
def _softmax_rows(x, ok):
    x = tl.where(ok, x, float("-inf"))
    e = tl.exp(x - tl.max(x, 1)[:, None])
    return e / tl.sum(e, 1)[:, None]


@triton.jit
def _residual_mlp(x, ref, p, up_w, up_b, down_w, down_b, level, cols, ok_cols, hidden, ok_hidden, D, H,
                  PRECISION: tl.constexpr):
    """r + down(silu(up(r))), r = x - p ref: x (C, D), ref (M, D), p (C, M); weights (L-1, H, D) / (L-1, D, H)."""
    r = x - tl.dot(p, ref, input_precision=PRECISION)
    w_up = tl.load(up_w + level * H * D + hidden[:, None] * D + cols[None, :],
                   mask=ok_hidden[:, None] & ok_cols[None, :], other=0.0)  # (H, D)
    h = tl.dot(r, tl.trans(w_up), input_precision=PRECISION) + tl.load(up_b + level * H + hidden, mask=ok_hidden,
                                                                       other=0.0)[None, :]
    h = h * tl.sigmoid(h)
    w_down = tl.load(down_w + level * D * H + cols[:, None] * H + hidden[None, :],
                     mask=ok_cols[:, None] & ok_hidden[None, :], other=0.0)  # (D, H)
    return r + tl.dot(h, tl.trans(w_down), input_precision=PRECISION) + tl.load(
        down_b + level * D + cols, mask=ok_cols, other=0.0)[None, :]


@triton.jit(do_not_specialize=["Tp", "NC"])
def _write_kernel(k_ptr, v_ptr, valid_ptr, reach_ptr, ks_ptr, vs_ptr, mass_ptr, rel_ptr, kref_ptr, vref_ptr,
                  proto_ptr, kappa_ptr, beta_ptr, kup_w, kup_b, kdown_w, kdown_b, vup_w, vup_b, vdown_w, vdown_b,
                  f_ptr, x_ptr, y_ptr, ks0_ptr, vs0_ptr, n0_ptr, r0_ptr,
                  Tp, NC, G, C, M, D, DV, HK, HV, tau, eps,
                  L: tl.constexpr, SIGMOID: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HV: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One program = one (batch row, KV head), every chunk of the call in order. The state (B, G, L, ...) is
    updated in place; F, X, Y (B, G, L, Tp, ...) and the chunk-start sums (B, G, NC, L, ...) are written."""
    pid = tl.program_id(0)  # b * G + g
    b, g = pid // G, pid % G
    head = pid.to(tl.int64)
    rows, slots = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_M)
    cd, cv, chk, chv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_HK), tl.arange(0, BLOCK_HV)
    row_ok, slot_ok, d_ok, v_ok = rows < C, slots < M, cd < D, cv < DV
    ok_md, ok_mv, ok_mm = slot_ok[:, None] & d_ok[None, :], slot_ok[:, None] & v_ok[None, :], \
        slot_ok[:, None] & slot_ok[None, :]
    ok_cm, ok_cd, ok_cv = row_ok[:, None] & slot_ok[None, :], row_ok[:, None] & d_ok[None, :], \
        row_ok[:, None] & v_ok[None, :]
    off_md, off_mv, off_mm = slots[:, None] * D + cd[None, :], slots[:, None] * DV + cv[None, :], \
        slots[:, None] * M + slots[None, :]
    reach = tl.load(reach_ptr + b)  # buffer rows this batch row's tokens reach (phase + real)
    for n in range(NC):
        t0 = n * C
        for i in range(L):  # the chunk-start sums, as the read side needs them
            state, start = head * L + i, (head * NC + n) * L + i
            tl.store(ks0_ptr + start * M * D + off_md, tl.load(ks_ptr + state * M * D + off_md, mask=ok_md),
                     mask=ok_md)
            tl.store(vs0_ptr + start * M * DV + off_mv, tl.load(vs_ptr + state * M * DV + off_mv, mask=ok_mv),
                     mask=ok_mv)
            tl.store(n0_ptr + start * M + slots, tl.load(mass_ptr + state * M + slots, mask=slot_ok), mask=slot_ok)
            if i < L - 1:
                relation, start_r = head * (L - 1) + i, (head * NC + n) * (L - 1) + i
                tl.store(r0_ptr + start_r * M * M + off_mm, tl.load(rel_ptr + relation * M * M + off_mm,
                                                                     mask=ok_mm), mask=ok_mm)
        tl.debug_barrier()
        token = head * Tp + t0 + rows  # (B, G, Tp) row index
        x_k = tl.load(k_ptr + token[:, None] * D + cd[None, :], mask=ok_cd, other=0.0)  # (C, D)
        x_v = tl.load(v_ptr + token[:, None] * DV + cv[None, :], mask=ok_cv, other=0.0)
        write = tl.load(valid_ptr + b.to(tl.int64) * Tp + t0 + rows, mask=row_ok, other=0.0)  # (C,) 0 or 1
        f_above = tl.zeros((BLOCK_C, BLOCK_M), dtype=tl.float32)
        for i in range(L):
            state = head * L + i
            key_ref = tl.load(kref_ptr + state * M * D + off_md, mask=ok_md, other=0.0)  # (M, D)
            value_ref = tl.load(vref_ptr + state * M * DV + off_mv, mask=ok_mv, other=0.0)
            scores = tl.dot(x_k, tl.trans(key_ref), input_precision=PRECISION) * tau  # (C, M)
            beta = tl.load(beta_ptr + g * L + i)
            if SIGMOID:
                f = tl.where(slot_ok[None, :], tl.sigmoid(beta * scores), 0.0)
                p = _softmax_rows(scores, slot_ok[None, :])
            else:
                f = _softmax_rows(beta * scores, slot_ok[None, :])
                p = f
            f = f * write[:, None]
            level_row = (head * L + i) * Tp + t0 + rows  # (B, G, L, Tp) row index
            tl.store(f_ptr + level_row[:, None] * M + slots[None, :], f, mask=ok_cm)
            tl.store(x_ptr + level_row[:, None] * D + cd[None, :], x_k, mask=ok_cd)
            tl.store(y_ptr + level_row[:, None] * DV + cv[None, :], x_v, mask=ok_cv)
            f_t = tl.trans(f)
            ks = tl.load(ks_ptr + state * M * D + off_md, mask=ok_md, other=0.0)
            tl.store(ks_ptr + state * M * D + off_md, ks + tl.dot(f_t, x_k, input_precision=PRECISION), mask=ok_md)
            vs = tl.load(vs_ptr + state * M * DV + off_mv, mask=ok_mv, other=0.0)
            tl.store(vs_ptr + state * M * DV + off_mv, vs + tl.dot(f_t, x_v, input_precision=PRECISION), mask=ok_mv)
            mass = tl.load(mass_ptr + state * M + slots, mask=slot_ok, other=0.0)
            tl.store(mass_ptr + state * M + slots, mass + tl.sum(f, 0), mask=slot_ok)
            if i > 0:  # relation_sum[i - 1] += F_{i-1}^T F_i
                relation = head * (L - 1) + i - 1
                r = tl.load(rel_ptr + relation * M * M + off_mm, mask=ok_mm, other=0.0)
                tl.store(rel_ptr + relation * M * M + off_mm,
                         r + tl.dot(tl.trans(f_above), f, input_precision=PRECISION), mask=ok_mm)
            if i < L - 1:
                x_k = _residual_mlp(x_k, key_ref, p, kup_w, kup_b, kdown_w, kdown_b, i, cd, d_ok, chk, chk < HK, D,
                                    HK, PRECISION)
                x_v = _residual_mlp(x_v, value_ref, p, vup_w, vup_b, vdown_w, vdown_b, i, cv, v_ok, chv, chv < HV,
                                    DV, HV, PRECISION)
            f_above = f
        tl.debug_barrier()
        if reach >= t0 + C:  # a boundary this row's tokens reach: the references become the current slots
            for i in range(L):
                state = head * L + i
                kappa = tl.load(kappa_ptr + g * L + i)
                mass = tl.load(mass_ptr + state * M + slots, mask=slot_ok, other=0.0)
                prototypes = tl.load(proto_ptr + (g * L + i) * M * D + off_md, mask=ok_md, other=0.0)
                ks = tl.load(ks_ptr + state * M * D + off_md, mask=ok_md, other=0.0)
                vs = tl.load(vs_ptr + state * M * DV + off_mv, mask=ok_mv, other=0.0)
                tl.store(kref_ptr + state * M * D + off_md,
                         (kappa * prototypes + ks) / tl.maximum(kappa + mass, eps)[:, None], mask=ok_md)
                tl.store(vref_ptr + state * M * DV + off_mv, vs / tl.maximum(mass, eps)[:, None], mask=ok_mv)
            tl.debug_barrier()


def _stacked(mlps, size, device):
    """The level MLPs' (up_w (L-1, H, D), up_b, down_w (L-1, D, H), down_b), fp32; one level of zeros if none."""
    if not mlps:
        return tuple(torch.zeros(1, *shape, device=device) for shape in ((1, size), (1,), (size, 1), (size,)))
    return tuple(torch.stack([getattr(mlp, name).detach().float() for mlp in mlps]).contiguous()
                 for name in ("up_weight", "up_bias", "down_weight", "down_bias"))


def write_chunks_triton(k_b, v_b, valid_b, layout: ChunkLayout, state: RSAState, params: RSAParams):
    """``write_chunks`` (no decay) in one launch: same arguments and results. No autograd: inference only."""
    batch, groups, padded, key_dim = k_b.shape
    value_dim, size = v_b.shape[-1], params.chunk_size
    _, levels, slots, _ = params.prototypes.shape
    chunks = padded // size
    fp32 = torch.float32
    k_b, v_b = k_b.to(fp32).contiguous(), v_b.to(fp32).contiguous()
    # the state's copy that the kernel updates in place (the caller's is left as it was)
    work = state.map(lambda t: t.to(fp32).clone(memory_format=torch.contiguous_format) if t.is_floating_point()
                     else t)
    key_mlps = _stacked(params.key_mlps, key_dim, k_b.device)
    value_mlps = _stacked(params.value_mlps, value_dim, k_b.device)
    hidden = (key_mlps[0].shape[1], value_mlps[0].shape[1])  # the key and value MLPs' widths
    empty = lambda *shape: k_b.new_empty(batch, groups, *shape)  # noqa: E731
    f, x, y = (empty(levels, padded, width) for width in (slots, key_dim, value_dim))  # (B, G, L, Tp, ...)
    ks0, vs0 = empty(chunks, levels, slots, key_dim), empty(chunks, levels, slots, value_dim)  # (B, G, NC, L, ...)
    n0, r0 = empty(chunks, levels, slots), empty(chunks, max(levels - 1, 0), slots, slots)
    reach = (layout.phase + layout.real).to(torch.int32).contiguous()
    fixed = (groups, size, slots, key_dim, value_dim, *hidden)  # the kernel's sizes but the buffer's length
    args = (k_b, v_b, valid_b.to(fp32).contiguous(), reach, work.key_sum, work.value_sum, work.mass,
            work.relation_sum if levels > 1 else n0, work.key_ref, work.value_ref,
            *(t.detach().to(fp32).contiguous() for t in (params.prototypes, params.kappa, params.beta)),
            *key_mlps, *value_mlps, f, x, y, ks0, vs0, n0, r0 if levels > 1 else n0,
            padded, chunks, *fixed, key_dim**-0.5, params.eps)
    constexprs = dict(L=levels, SIGMOID=params.assign_fn == "sigmoid", BLOCK_C=tile_edge(size),
                      BLOCK_M=tile_edge(slots), BLOCK_D=tile_edge(key_dim), BLOCK_DV=tile_edge(value_dim),
                      BLOCK_HK=tile_edge(hidden[0]), BLOCK_HV=tile_edge(hidden[1]),
                      PRECISION=INPUT_PRECISION, num_warps=NUM_WARPS)
    grid = (batch * groups,)
    if k_b.device.type == "cuda":  # compiled before its first launch (the interpreter compiles nothing)
        compile_side_by_side("RSA chunk write", ("rsa-write", k_b.device, tuple(sorted(constexprs.items())), fixed),
                             lambda: [(_write_kernel, grid, args, constexprs)])
    if chunks and batch * groups:
        _write_kernel[grid](*args, **constexprs)
    work = replace(work, count=state.count + layout.real)
    return ChunkWrites(f, x, y, ks0, vs0, n0, r0), work
