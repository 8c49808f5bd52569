"""Attention over the rows a support table names (kernels/sparse_attention.py), GLTM's A-branch: the flex_attention
path against the gathered PyTorch form, the reference, in fp64 on CPU; the block mask against the table; the rows a
GLTM layer shares across sequences against the rows it looks up per call.

flex_attention runs on CPU in its eager (dense) form, with the same block mask as the fused CUDA kernel; its backward
goes through apps/bench/op_count.py ``_flex_attention_with_cpu_backward`` (torch refuses one on CPU). The fused
kernel's equality runs on a GPU (tests/gpu/test_libraries_cuda.py).
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings
from hf_mixers.apps.bench.op_count import _flex_attention_with_cpu_backward
from hf_mixers.kernels.dispatch import library_stand_ins
from hf_mixers.kernels.sparse_attention import (flex_sparse_attention, gather_rows, gathered_softmax_reference,
                                                sparse_attention, support_block_mask)
from hf_mixers.kernels.token_patterns import PATTERNS, RECURRENT, support_rows

F64 = torch.float64
FLEX = "torch.nn.attention.flex_attention.flex_attention"
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


def a_table(pattern, length, window=3):
    """GLTM's A-support of positions 1..T as rows of the T tokens (-1: none): each token itself and its B-support."""
    positions = torch.arange(1, length + 1)
    return torch.cat([positions[:, None], support_rows(pattern, positions, window)], -1) - 1


def attention_inputs(length, batch=2, per_group=3, dim=8, value_dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, length, per_group, dim, generator=g, dtype=F64),
            torch.randn(batch, length, dim, generator=g, dtype=F64),
            torch.randn(batch, length, value_dim, generator=g, dtype=F64))


def test_the_gathered_form_is_softmax_attention_over_the_rows_named():
    """Against a dense masked softmax: the table as a T x N mask."""
    q, keys, values = attention_inputs(11)
    table = a_table("quad_ce", 11)
    got = sparse_attention(q, keys, values, table.expand(2, -1, -1), 0.4)
    allowed = (table[:, :, None] == torch.arange(11)).any(1)  # (T, N)
    scores = torch.einsum("btgd,bnd->btgn", q, keys) * 0.4
    weights = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    torch.testing.assert_close(got, torch.einsum("btgn,bnd->btgd", weights, values), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("pattern,length", [("pow2_ce", 70), ("quad_ce", 53), ("banded", 40), ("pow2", 33),
                                            ("custom_ce", 50)])
def test_the_flex_path_equals_the_gathered_form(pattern, length, block):
    """Output and the gradients of q, keys and values, one flex_attention call with the table as its mask_mod."""
    table = a_table(pattern, length) if pattern != "custom_ce" else torch.cat(
        [torch.arange(length)[:, None], support_rows(pattern, torch.arange(1, length + 1), offsets="pow:3") - 1], -1)
    leaves = attention_inputs(length)
    probe = torch.randn(2, length, 3, 5, generator=torch.Generator().manual_seed(9), dtype=F64)
    mask = support_block_mask(table, block)
    results = []
    for attend in (lambda q, k, v: sparse_attention(q, k, v, table.expand(2, -1, -1), 0.4),
                   lambda q, k, v: flex_sparse_attention(q, k, v, mask, 0.4, _flex_attention_with_cpu_backward)):
        tensors = [t.clone().requires_grad_() for t in leaves]
        out = attend(*tensors)
        results.append((out, *torch.autograd.grad((out * probe).sum(), tensors)))
    for name, expected, actual in zip(("output", "d q", "d keys", "d values"), *results):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("pattern,length,block", [("pow2_ce", 300, 16), ("quad_ce", 129, 16), ("local", 100, 32),
                                                  ("pow2", 256, 128)])
def test_the_block_mask_reads_exactly_the_table(pattern, length, block):
    """The mask_mod allows exactly the table's entries, and the blocks listed are exactly those holding one."""
    table = a_table(pattern, length) if pattern != "local" else torch.arange(length)[:, None] - torch.arange(4)
    table = table.clamp(min=-1)  # local: before the first token, none
    mask = support_block_mask(table, block)
    dense = create_mask(mask.mask_mod, None, None, length, length, device="cpu")[0, 0]
    expected = torch.zeros(length, length, dtype=torch.bool)
    rows, columns = (table >= 0).nonzero(as_tuple=True)
    expected[rows, table[rows, columns]] = True
    assert torch.equal(dense, expected)
    padded = torch.nn.functional.pad(dense, (0, -length % block, 0, -length % block))
    touched = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block)).any(3).any(1)
    listed = torch.zeros_like(touched)
    for row, (count, indices) in enumerate(zip(mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0])):
        listed[row, indices[:count]] = True
    assert torch.equal(listed, touched)


def test_dispatch_takes_flex_only_for_a_shared_table_where_flex_runs():
    """On CPU the gathered form runs; where flex would run (its CPU stand-in in place, as the op counter uses) it
    takes a call whose rows every sequence shares (``shared`` names the table), and never an fp64 one."""
    q, keys, values = (t.float() for t in attention_inputs(40))
    table = a_table("pow2_ce", 40).expand(2, -1, -1)
    want = sparse_attention(q, keys, values, table, 0.4)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args[0].shape)
        return _flex_attention_with_cpu_backward(*args, **kwargs)

    with library_stand_ins({FLEX: stand_in}):
        torch.testing.assert_close(sparse_attention(q, keys, values, table, 0.4), want)
        assert not calls  # rows not named as shared: they may differ by sequence
        got = sparse_attention(q, keys, values, table, 0.4, shared=("test", "pow2_ce", 40))
        assert len(calls) == 1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        sparse_attention(q.double(), keys.double(), values.double(), table, 0.4, shared=("test", "pow2_ce", 40))
        assert len(calls) == 1


def test_gather_rows_and_the_reference_weights_sum_to_one_on_rows_with_a_key():
    q, keys, _ = attention_inputs(9)
    table = a_table("pow2_ce", 9).expand(2, -1, -1)
    weights = gathered_softmax_reference(q, keys, table, 0.4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 9, 3, dtype=F64))
    assert torch.equal(gather_rows(keys, table.clamp(min=0))[0, 5, 0], keys[0, 5])


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p in RECURRENT and p not in ("dense",)] + ["local"])
def test_a_packed_gltm_layer_reads_the_rows_it_would_look_up(pattern):
    """With no padding and no past a GLTM layer reads the support rows every sequence shares (built once a length);
    with a token mask of all ones it looks them up per call: the same output and gradients, every sparse pattern."""
    options = {"gltm_pattern": pattern, "gltm_chunk_size": 4, "kernel_backend": "torch"}
    if pattern.startswith("custom"):
        options["gltm_offsets"] = "pow:3"
    results = []
    for token_mask in (None, torch.ones(2, 21, dtype=torch.bool)):
        torch.manual_seed(0)
        module, config = build_mixer("gltm", options, 32, 4, 2, "cpu", F64)
        x = torch.randn(2, 21, 32, dtype=F64, requires_grad=True)
        out = module(x, rotary_embeddings(config, x, 21), None, token_mask)
        out.pow(2).sum().backward()
        results.append([out, x.grad] + [p.grad for p in module.parameters() if p.grad is not None])
    for expected, actual in zip(*results, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
