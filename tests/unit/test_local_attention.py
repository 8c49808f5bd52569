"""The local window's attention (kernels/local_attention.py): the flex_attention path against the PyTorch block form,
the reference, in fp64 on CPU.

flex_attention runs on CPU in its eager (dense) form, which takes the same block mask and score_mod as the fused CUDA
kernel; torch refuses its backward on CPU (its CPU compile has none), so the gradients are checked through the dense
backward that check guards (apps/bench/op_count.py ``_flex_attention_with_cpu_backward``). The fused kernel's own
equality runs on a GPU (tests/gpu/test_libraries_cuda.py).
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings
from hf_mixers.apps.bench.op_count import _flex_attention_with_cpu_backward
from hf_mixers.kernels import local_attention as module
from hf_mixers.kernels.dispatch import library_stand_ins
from hf_mixers.kernels.local_attention import band_block_mask, flex_window_attention, local_attention, window_attention

F64 = torch.float64
FLEX = "torch.nn.attention.flex_attention.flex_attention"
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


def inputs(window, length, past=0, batch=3, groups=2, per_group=3, dim=8, value_dim=5, seed=0):
    """Queries for ``length`` new tokens, w earlier positions (``past`` of them real) then the new ones; row 1 left
    padded (its first 4 tokens), row 2 all padding up to its last 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    span = window + length
    query = torch.randn(batch, groups, per_group, length, dim, generator=g, dtype=F64)
    keys = torch.randn(batch, groups, span, dim, generator=g, dtype=F64)
    values = torch.randn(batch, groups, span, value_dim, generator=g, dtype=F64)
    valid = torch.zeros(batch, span, dtype=torch.bool)
    valid[:, window - past:] = True
    valid[1, :window + 4] = False
    valid[2, :span - 2] = False
    return query, keys, values, valid


def real_queries(t, valid, window):
    """The entries of (B, G, g, T, ...) at real tokens (a padding query's output is read by nobody)."""
    return t.movedim(3, 1)[valid[:, window:]]


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("window, length, past", [(4, 40, 0), (8, 37, 8), (20, 64, 5), (40, 33, 40), (1, 20, 1)])
def test_flex_path_equals_the_block_form(window, length, past, block, monkeypatch):
    """Output, log normaliser and normalised entropy of every real query, from one flex_attention call with the band
    as a block mask (blocks of 16: a band across many blocks) and the padding as a score_mod."""
    monkeypatch.setattr(module, "FLEX_BLOCK", block)
    query, keys, values, valid = inputs(window, length, past)
    want = window_attention(query, keys, values, valid, window, 0.3, with_entropy=True)
    got = flex_window_attention(query, keys, values, valid, window, 0.3, with_entropy=True)
    for name, a, b in zip(("output", "log normaliser", "entropy"), got, want, strict=True):
        torch.testing.assert_close(real_queries(a, valid, window), real_queries(b, valid, window), rtol=1e-12,
                                   atol=1e-12, msg=name)
    out, log_normaliser = flex_window_attention(query, keys, values, valid, window, 0.3)
    # the same read without the keys beside the values: equal to rounding (a wider value matrix may sum in
    # another order, as AVX-512 kernels do)
    torch.testing.assert_close(out, got[0], rtol=1e-13, atol=1e-13)
    # a query that sees no real key reads its own position: its value, and a finite log normaliser with no clamp
    # after the kernel, so a shared normaliser stays finite
    empty = ~valid[2, window:]
    own_values = values[2, :, window:][:, None, empty].expand(-1, query.shape[2], -1, -1)
    torch.testing.assert_close(out[2, :, :, empty], own_values, rtol=1e-13, atol=1e-13)
    assert torch.isfinite(log_normaliser).all()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_flex_path_gradients_equal_the_block_forms(with_entropy, monkeypatch):
    monkeypatch.setattr(module, "FLEX_BLOCK", 16)
    window, length = 8, 45
    leaves = inputs(window, length, past=3)[:3]
    valid = inputs(window, length, past=3)[3]
    probes = [torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=F64)
              for i, shape in enumerate(((3, 2, 3, length, 5), (3, 2, 3, length), (3, 2, 3, length)))]

    def gradients(attend, **kwargs):
        tensors = [t.clone().requires_grad_() for t in leaves]
        outputs = attend(*tensors, valid, window, 0.3, with_entropy=with_entropy, **kwargs)
        loss = sum((real_queries(out * probe if out.dim() == 4 else out * probe, valid, window)).sum()
                   for out, probe in zip(outputs, probes))
        return torch.autograd.grad(loss, tensors)

    got = gradients(flex_window_attention, flex=_flex_attention_with_cpu_backward)
    for name, a, b in zip("qkv", got, gradients(window_attention), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("length, window, block", [(100, 8, 16), (37, 20, 16), (300, 64, 128), (129, 1, 128)])
def test_the_band_block_mask_lists_exactly_the_blocks_the_band_reads(length, window, block):
    span = window + length
    mask = band_block_mask(length, span, window, "cpu", block=block)
    dense = create_mask(mask.mask_mod, None, None, length, span, device="cpu")[0, 0]
    blocks = torch.nn.functional.pad(dense, (0, -span % block, 0, -length % block))
    touched = blocks.unflatten(0, (-1, block)).unflatten(2, (-1, block)).any(3).any(1)  # (query blocks, key blocks)
    listed = torch.zeros_like(touched)
    for row, (count, indices) in enumerate(zip(mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0])):
        listed[row, indices[:count]] = True
    assert torch.equal(listed, touched)
    assert mask.full_kv_num_blocks is None  # every block applies the mask_mod and the score_mod


def test_dispatch_takes_flex_on_cuda_calls_longer_than_the_window_only():
    """On CPU the PyTorch form runs ("triton" asks for the fast path and fails, naming why); where flex would run
    (here: a CPU stand-in in its place, as the op counter uses) it takes calls longer than the window, in fp32 or
    bf16, and leaves the rest to the block form."""
    window, length = 4, 12
    query, keys, values, valid = (t.float() if t.is_floating_point() else t for t in inputs(window, length))
    want = window_attention(query, keys, values, valid, window, 0.3)
    torch.testing.assert_close(local_attention(query, keys, values, valid, window, 0.3), want)
    with pytest.raises(RuntimeError, match="local window attention.*tensors on cpu"):
        local_attention(query, keys, values, valid, window, 0.3, backend="triton")
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args[0].shape)
        return _flex_attention_with_cpu_backward(*args, **kwargs)

    with library_stand_ins({FLEX: stand_in}):
        got = local_attention(query, keys, values, valid, window, 0.3)
        assert len(calls) == 1
        for a, b in zip(got, want):
            torch.testing.assert_close(real_queries(a, valid, window), real_queries(b, valid, window))
        local_attention(query[:, :, :, :window], keys[:, :, :2 * window], values[:, :, :2 * window],
                        valid[:, :2 * window], window, 0.3)  # no longer than the window
        local_attention(*(t.double() for t in (query, keys, values)), valid, window, 0.3)  # fp64
        local_attention(query, keys, values, valid, window, 0.3, backend="torch")
        assert len(calls) == 1


WINDOWED = [("rsa", {"rsa_window": 8, "rsa_readout": "softmax_count", "rsa_chunk_size": 8}),
            ("vort", {"vort_window": 8}), ("selective_ssm", {"selective_ssm_window": 8})]


@pytest.mark.parametrize("mixer, options", WINDOWED, ids=[m for m, _ in WINDOWED])
def test_a_windowed_mixer_through_flex_equals_its_pytorch_path(mixer, options):
    """A layer's output and gradients, packed and left padded, with the window through flex_attention (its CPU
    form, where CUDA would run the fused kernel) and through the block form: the mixers hand the window's path to
    kernels/local_attention.py (VORT's order reads the entropy from the same flex call)."""
    torch.manual_seed(0)
    layer, config = build_mixer(mixer, options, 32, 4, 2, "cpu", F64)
    x = torch.randn(2, 30, 32, dtype=F64)
    token_mask = torch.ones(2, 30, dtype=torch.bool)
    token_mask[1, :6] = False
    embeddings = rotary_embeddings(config, x, 30)

    def run():
        leaf = x.clone().requires_grad_()
        out = layer(leaf, embeddings, token_mask=token_mask)
        out = out[token_mask]
        grads = torch.autograd.grad(out.pow(2).sum(), [leaf, *layer.parameters()], allow_unused=True)
        return out, grads

    want = run()
    calls = []

    def flex(*args, **kwargs):
        calls.append(kwargs["return_aux"])
        return _flex_attention_with_cpu_backward(*args, **kwargs)

    with library_stand_ins({FLEX: flex}):
        with pytest.MonkeyPatch.context() as patch:  # fp64 here: let the flex path take it
            patch.setattr(module, "_flex_unsupported", lambda query, length, window: None)
            got = run()
    assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    for a, b in zip(got[1], want[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mixer, options", WINDOWED[:2], ids=[m for m, _ in WINDOWED[:2]])
def test_the_flex_path_compiles_as_one_graph(mixer, options):
    """Inside a compiled block (``train.compile``) the dispatch, the band's block mask and the padding's score_mod
    trace with no graph break, and flex_attention is traced as itself. (On CPU without gradients: torch's CPU
    flex_attention has no backward.)"""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    layer, config = build_mixer(mixer, options, 32, 4, 2, "cpu", torch.float32)
    x = torch.randn(2, 30, 32)
    token_mask = torch.ones(2, 30, dtype=torch.bool)
    token_mask[1, :6] = False
    embeddings = rotary_embeddings(config, x, 30)
    calls = []

    def flex(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return flex_attention(*args, **kwargs)

    torch._dynamo.reset()
    with library_stand_ins({FLEX: flex}), torch.no_grad():
        want = layer(x, embeddings, token_mask=token_mask)
        got = torch.compile(layer, fullgraph=True, backend="eager")(x, embeddings, token_mask=token_mask)
    assert calls == [False, True]
    torch.testing.assert_close(got[token_mask], want[token_mask], rtol=1e-5, atol=1e-6)
