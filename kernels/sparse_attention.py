"""Softmax attention over the rows a support table names: GLTM's sparse patterns (kernels/token_patterns.py).

A table ``support`` (B, T, K) lists for each query the rows of the keys it reads (-1: none); q (B, T, g, d) holds
the g query heads that share a key head (GQA), keys / values (B, N, d / dv). A row with no key has weights 0 and
output 0.

    gathered_softmax    the weights (B, T, g, K): the K keys gathered, their softmax. The PyTorch form is the
                        reference; on Triton one launch each way (kernels/sparse_attention_triton.py)
    sparse_attention    the read (B, T, g, dv): the weights applied to the gathered values; or, where every row of
                        the call reads the same table (``shared``: a training step, a prefill with no padding and no
                        past) on CUDA, torch's flex_attention with the table as its mask_mod and the key blocks it
                        touches as its BlockMask (``support_block_mask``): one fused launch forward, one backward

Memory of the gathered forms: (B, T, K, d) gathered keys, instead of a T x N score matrix.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .conventions import compute_dtype, outside_autocast, shape_constant
from .dispatch import library_kernel, use_triton
from .local_attention import FLEX_BLOCK, compiled_flex


def gather_rows(x, index):
    """x (B, N, D) at index (B, C, K) (each in [0, N)) -> (B, C, K, D)."""
    return x.gather(1, index.flatten(1)[..., None].expand(-1, -1, x.shape[-1])).view(*index.shape, x.shape[-1])


def gathered_softmax_reference(q, keys, support, scale, gain=None):
    """``gathered_softmax``'s math in PyTorch: the reference of its kernel, and the CPU path."""
    valid = (support >= 0)[:, :, None]  # (B, T, 1, K)
    gathered = gather_rows(keys, support.clamp(min=0))
    logits = torch.einsum("btgd,btkd->btgk", q, gathered) * scale
    logits = logits.masked_fill(~valid, float("-inf")).masked_fill(~valid.any(-1, keepdim=True), 0.0)
    weights = torch.softmax(logits, dim=-1).masked_fill(~valid, 0.0)
    return weights if gain is None else gain[..., None] * weights


@outside_autocast
def gathered_softmax(q, keys, support, scale, gain=None, backend="auto"):
    """Softmax of <q_t, keys_j> * scale over the keys row t of ``support`` names, times ``gain`` (B, T, g) where
    given: q (B, T, g, d), keys (B, N, d), support (B, T, K) -> weights (B, T, g, K) in the compute dtype, 0 at -1
    and all 0 on a row with no key. One Triton launch each way where kernels/dispatch.py takes Triton for
    ``backend``."""
    cd = compute_dtype(q.dtype)
    q, keys, gain = q.to(cd), keys.to(cd), None if gain is None else gain.to(cd)
    if use_triton("GLTM gathered softmax", q.device, backend, check=lambda: None if q.shape[-1] <= 256 else
                  f"heads of {q.shape[-1]} features (the kernel takes up to 256)"):
        from .sparse_attention_triton import gathered_softmax_triton

        return gathered_softmax_triton(q, keys, support, scale, gain)
    return gathered_softmax_reference(q, keys, support, scale, gain)


@outside_autocast
def sparse_attention(q, keys, values, support, scale, shared=None, backend="auto"):
    """Softmax attention of each query over the rows ``support`` names -> (B, T, g, dv) in the compute dtype.

    ``shared``: a hashable name for the table when every row of ``support`` is that same table, keys and values
    holding exactly the T new tokens (N = T). flex_attention may then take the call (CUDA), with its block mask built
    once per name (``support_block_mask``); otherwise the gathered form runs."""
    cd = compute_dtype(q.dtype)
    flex = None if shared is None else library_kernel(
        "GLTM sparse attention", "torch.nn.attention.flex_attention", "flex_attention", q.device, backend,
        check=lambda: None if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else
        f"{q.dtype} inputs (flex_attention's kernel takes fp32 at most)")
    if flex is not None:
        if q.device.type == "cuda":
            flex = compiled_flex(flex)
        mask = shape_constant(("support mask", shared, str(q.device)), lambda: support_block_mask(support[0]))
        return flex_sparse_attention(q, keys, values, mask, scale, flex).to(cd)
    weights = gathered_softmax(q, keys, support, scale, backend=backend)
    return torch.einsum("btgk,btkd->btgd", weights, gather_rows(values.to(cd), support.clamp(min=0)))


def flex_sparse_attention(q, keys, values, block_mask, scale, flex=None):
    """``sparse_attention`` through flex_attention (``flex``: the function to call, torch's by default): q (B, T, g,
    d), keys / values (B, T, d / dv), ``block_mask`` from ``support_block_mask`` -> (B, T, g, dv) in q's dtype."""
    flex = flex or flex_attention
    out = flex(q.transpose(1, 2), keys[:, None], values[:, None], block_mask=block_mask, scale=scale,
               enable_gqa=True)  # the g query heads against one key head
    return out.transpose(1, 2)


def support_block_mask(table, block: int | None = None) -> BlockMask:
    """A table (T, K) of key rows (-1: none) as a flex BlockMask over T queries and T keys: the mask_mod reads the
    table (key j is read by query i when j is in row i), the blocks listed are exactly the key blocks some query of
    each query block reads (from the table, O(T K): no mask evaluated over the T x T grid), none marked full."""
    block = block or FLEX_BLOCK
    length, width = table.shape
    blocks = -(-length // block)
    rows = (torch.arange(length, device=table.device) // block)[:, None].expand(length, width)
    columns = torch.where(table >= 0, table // block, blocks)  # none: a spare column, dropped
    touched = torch.zeros(blocks, blocks + 1, dtype=torch.bool, device=table.device)
    touched = touched.index_put((rows, columns), torch.ones((), dtype=torch.bool, device=table.device))[:, :blocks]
    order = torch.sort(touched.int(), dim=-1, descending=True, stable=True).indices
    table = table.contiguous()

    def reads(batch, head, query, key):
        row = query.clamp(max=length - 1)  # a last block's padded queries read a real row; their scores are dropped
        hit = table[row, 0] == key
        for column in range(1, width):
            hit = hit | (table[row, column] == key)
        return hit

    return BlockMask.from_kv_blocks(touched.sum(-1).int()[None, None], order.int()[None, None], BLOCK_SIZE=block,
                                    mask_mod=reads, seq_lengths=(length, length))
