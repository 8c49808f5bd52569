"""The local window's Triton kernels against their PyTorch references, values and every gradient in fp64: the
shared-normaliser combine of the window's and a memory's reads (kernels/window_combine_triton.py against
kernels/window_combine.py ``combine_reads``: queries whose memory has seen nothing, widths and query counts that do
not fill a block) and the flex read's entropy epilogue (kernels/local_attention_triton.py against
kernels/local_attention.py ``flex_read_entropy``: padding, queries that see no key, a window longer than a block)."""

import pytest
import torch

from triton_interpreter import DEVICE, interpreter_only, needs_kernels, run_under_interpreter

from hf_mixers.apps.bench.op_count import count_ops
from hf_mixers.kernels.local_attention import flex_read_entropy
from hf_mixers.kernels.window_combine import combine_reads


@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def _reads(dtype, batch=2, groups=3, per_group=2, length=11, width=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE, dtype)  # noqa: E731
    seen = torch.ones(batch, length, dtype=torch.bool)
    seen[0, :4] = False  # a left-padded row: its first queries' memories are empty
    seen = seen.to(DEVICE)
    # the memory's output read as a (B, G, g, T, dv) view of a (B, T, G, g, dv) tensor, as fla returns it
    remote = make(batch, length, groups, per_group, width).permute(0, 2, 3, 1, 4)
    return (make(batch, groups, per_group, length, width), make(batch, groups, per_group, length), remote,
            make(batch, groups, per_group, length), seen)


def _as_memory_channels(remote, remote_log):
    """The memory's read and log weight as RSA's read returns them: channels of one (B, G, g, T, dv + 1) tensor."""
    return (lambda wide: (wide[..., :-1], wide[..., -1]))(torch.cat([remote, remote_log[..., None]], -1))


@needs_kernels
@pytest.mark.parametrize("layout", ["views", "channels"])
def test_shared_combine_and_its_gradients_equal_the_reference_in_fp64(layout):
    """Reads as views of (B, T, H, dv) tensors (the memory's) or, with the output's gradient too, as channels of a
    wider tensor (RSA's read and its log weight): the kernels take each by its strides."""
    local, local_log, remote, remote_log, seen = _reads(torch.float64)  # 132 queries: 3 programs, the last ragged
    g = torch.randn(local.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    if layout == "channels":
        remote, remote_log = _as_memory_channels(remote, remote_log)
        g = g.transpose(1, 3).contiguous().transpose(1, 3)  # (B, T, g, G, dv) underneath: G and g do not merge
    results = {}
    for backend in ("torch", "triton"):
        inputs = [t.clone().requires_grad_() for t in (local, local_log, remote, remote_log)]
        out = combine_reads(*inputs[:4], seen, "shared", backend=backend)
        results[backend] = (out, *torch.autograd.grad((out * g).sum(), inputs))
    names = ("out", "d local", "d local log", "d remote", "d remote log")
    for name, expected, actual in zip(names, results["torch"], results["triton"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-14, msg=name)
    out, _, d_local_log, d_remote, _ = results["triton"]
    # an unseen memory: the window alone, nothing flows into the memory
    assert torch.equal(out[0, :, :, :4], local[0, :, :, :4]) and not d_remote[0, :, :, :4].any()
    assert not d_local_log[0, :, :, :4].any()


@interpreter_only  # the counter sees interpreted launches
def test_one_launch_each_way_and_no_host_read():
    inputs = [t.requires_grad_() for t in _reads(torch.float32)[:4]]
    seen = _reads(torch.float32)[4]
    count, _ = count_ops(lambda: combine_reads(*inputs, seen, "shared", backend="triton").sum().backward())
    assert count.triton_launches == 2 and count.host_reads == 0, count.top()
    # RSA's read and log weight as channels of one tensor, the window's read a view of (B, T, H, dv), the output's
    # gradient dense: every one taken in place, no copy
    wide = torch.cat([inputs[2].detach(), inputs[3].detach()[..., None]], -1).requires_grad_()
    weights = torch.randn(inputs[0].shape)
    count, _ = count_ops(lambda: (combine_reads(inputs[0], inputs[1], wide[..., :-1], wide[..., -1], seen, "shared",
                                                backend="triton") * weights).sum().backward())
    assert not {"clone", "contiguous"} & set(count.by_name), count.top()


def test_the_reference_names_its_mistakes():
    generator = torch.Generator().manual_seed(0)
    local, remote = (torch.randn(1, 1, 1, 3, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    local_log, remote_log = (torch.randn(1, 1, 1, 3, generator=generator, dtype=torch.float64) for _ in range(2))
    seen = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs a memory that returns its log weight"):
        combine_reads(local, local_log, remote, None, seen, "shared", backend="torch")
    with pytest.raises(ValueError, match="combine must be one of"):
        combine_reads(local, local_log, remote, remote_log, seen, "product", backend="torch")



@needs_kernels
@pytest.mark.parametrize("window", [5, 80], ids=["short_window", "window_over_a_block"])
def test_flex_read_entropy_and_its_gradients_equal_the_reference_in_fp64(window):
    """flex's output over [values, keys] split into the read, log Z and the normalised entropy: values and the
    gradients of the output, lse and the queries; left padding (queries that see one key or none: lse -inf)."""
    batch, groups, per_group, length, width, value_dim = 2, 2, 3, 19, 8, 6
    generator = torch.Generator().manual_seed(2)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE)  # noqa: E731
    out = make(batch, groups, per_group, length, value_dim + width)
    lse = make(batch, groups, per_group, length)
    valid = torch.ones(batch, window + length, dtype=torch.bool)
    valid[:, :window] = False  # a first call: the w positions before it are padding
    valid[0, window:window + 4] = False  # a left-padded row
    valid = valid.to(DEVICE)
    lse[0, :, :, :3] = -float("inf")  # queries that see no key
    # the queries as a layer hands them over: (B, T, heads, d) transposed
    query = make(batch, length, groups * per_group, width).transpose(1, 2).unflatten(1, (groups, per_group))
    grads = [make(batch, groups, per_group, length, value_dim), make(batch, groups, per_group, length),
             make(batch, groups, per_group, length)]
    results = {}
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (out, lse, query)]
        outputs = flex_read_entropy(leaves[0], leaves[1], leaves[2], valid, window, value_dim, 0.35, backend=backend)
        loss = sum((o * g).sum() for o, g in zip(outputs, grads))
        results[backend] = (*outputs, *torch.autograd.grad(loss, leaves))
    names = ("values", "log Z", "entropy", "d out", "d lse", "d query")
    for name, expected, actual in zip(names, results["torch"], results["triton"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-14, msg=name)
    entropy = results["triton"][2]
    assert not entropy[0, :, :, :4].any()  # at most one valid key: 0
