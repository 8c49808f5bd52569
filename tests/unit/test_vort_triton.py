"""VORT's Triton kernels against their PyTorch references, values and gradients in fp64, fp32 within rounding:
the write weights (kernels/soe_triton.py against kernels/soe.py ``write_weights``: padding, delays, both alpha
kernels, alpha = 1, slot counts that do not fill the tile), the Hedgehog feature maps (kernels/hedgehog_triton.py
against kernels/hedgehog.py ``hedgehog``: row and column counts that do not fill a block), the normalised read
(kernels/retention_triton.py against kernels/retention.py ``normalised_read``: empty memories, eps0 = 0, the
FAVOR+ offset), and a converted layer with all of them."""

import pytest
import torch

from triton_interpreter import DEVICE, interpreter_only, needs_kernels, padded_layer_step, run_under_interpreter

from hf_mixers.apps.bench.op_count import count_ops
from hf_mixers.kernels.hedgehog import hedgehog, hedgehog_pair
from hf_mixers.kernels.retention import normalised_read
from hf_mixers.kernels.soe import write_weights
from hf_mixers.testing import check_step_compiles_whole


@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


def _inputs(batch, groups, length, dtype, padded, seed=0):
    generator = torch.Generator().manual_seed(seed)
    alpha = 0.1 + 0.9 * torch.rand(batch, groups, length, generator=generator, dtype=torch.float64)
    alpha[0, 0, :3] = torch.tensor([1.0, 0.9999, 0.1], dtype=torch.float64)  # alpha = 1: sin and sinc's limits
    keep = None
    if padded:
        keep = torch.ones(batch, length, dtype=torch.float64)
        keep[0, :length // 3] = 0  # a left-padded row
        alpha[0, :, 3:5] = 0  # padding may carry alpha = 0 (the window pads its delayed inputs with zeros)
    move = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return move(alpha), move(keep)


def _both(alpha, keep, lag, terms, kernel, backend):
    alpha = alpha.detach().requires_grad_()
    weights, skip = write_weights(alpha, keep, lag, terms, 512, 1e-3, kernel, backend=backend)
    return alpha, weights, skip


@needs_kernels
@pytest.mark.parametrize("kernel", ["gl", "power"])
@pytest.mark.parametrize("lag,padded", [(0, False), (0, True), (16, True)], ids=["plain", "padded", "delayed"])
@pytest.mark.parametrize("terms", [15, 4])
def test_weights_and_gradients_equal_the_reference_in_fp64(kernel, lag, padded, terms):
    alpha, keep = _inputs(2, 3, 150, torch.float64, padded)  # 900 tokens: 7 programs, the last one ragged
    generator = torch.Generator().manual_seed(1)
    g_weights = torch.randn(2, 3, 150, terms + 1, generator=generator, dtype=torch.float64).to(DEVICE)
    g_skip = torch.randn(2, 3, 150, generator=generator, dtype=torch.float64).to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        a, weights, skip = _both(alpha, keep, lag, terms, kernel, backend)
        grad, = torch.autograd.grad((weights * g_weights).sum() + (skip * g_skip).sum(), a)
        results[backend] = weights, skip, grad
    for name, expected, actual in zip(("weights", "skip", "d alpha"), results["torch"], results["triton"]):
        # sinc'(b) near b = 0 cancels in both forms (cos(pi b) - sinc(b)): 1e-11 relative at alpha = 0.9999
        torch.testing.assert_close(actual, expected, rtol=1e-11, atol=1e-13, msg=name)
    if padded:  # a padding token writes nothing and gets no gradient, alpha = 0 included
        for weights, skip, grad in results.values():
            assert not weights[0, :, :50].any() and not skip[0, :, :50].any() and not grad[0, :, :50].any()


@needs_kernels
def test_a_loss_of_the_weights_alone_reaches_alpha():
    """VORT's delayed writes use the weights and not the skip: the skip's gradient is absent, not an error."""
    alpha, keep = _inputs(1, 2, 40, torch.float64, True)
    grads = []
    for backend in ("torch", "triton"):
        a, weights, _ = _both(alpha, keep, 8, 15, "gl", backend)
        grads.append(torch.autograd.grad(weights.pow(2).sum(), a)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-14)


@needs_kernels
def test_fp32_within_rounding_of_fp64():
    alpha, keep = _inputs(2, 2, 70, torch.float64, True)
    exact = _both(alpha, keep, 0, 15, "gl", "torch")
    fast = _both(alpha.float(), keep.float(), 0, 15, "gl", "triton")
    for expected, actual in zip(exact[1:], fast[1:]):
        torch.testing.assert_close(actual.double(), expected.detach(), rtol=2e-5, atol=1e-7)


@interpreter_only  # the counter sees interpreted launches
def test_one_launch_each_way():
    alpha, keep = _inputs(1, 2, 40, torch.float32, True)
    alpha.requires_grad_()

    def step():
        weights, skip = write_weights(alpha, keep, 0, 15, 512, 1e-3, "gl", backend="triton")
        (weights.sum() + skip.sum()).backward()

    count, _ = count_ops(step)
    assert count.triton_launches == 2 and count.host_reads == 0, count.top()


def test_the_reference_applies_keep_and_delay_to_soe_weights():
    """The PyTorch path is soe_weights times keep and e^(l_s lag), shape-checked."""
    from hf_mixers.kernels.soe import soe_log_rates, soe_weights

    alpha = torch.rand(2, 3, 5, dtype=torch.float64) * 0.9 + 0.1
    keep = torch.tensor([[0.0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float64)
    weights, skip = write_weights(alpha, keep, 7, 15, 512, backend="torch")
    plain_w, plain_s = soe_weights(alpha, 15, 512)
    decay = torch.exp(7 * soe_log_rates(15, 512))
    torch.testing.assert_close(weights, plain_w * keep[:, None, :, None] * decay, rtol=1e-15, atol=0)
    torch.testing.assert_close(skip, plain_s * keep[:, None], rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=r"keep \(B, T\)"):
        write_weights(alpha, keep[:, :4], 0, 15, 512, backend="torch")


# --- the Hedgehog feature maps

@needs_kernels
@pytest.mark.parametrize("batch,groups,per_group,length,width,half", [(2, 2, 3, 37, 16, 8), (1, 3, 2, 45, 64, 64)],
                         ids=["small", "column_blocks"])
def test_hedgehog_pair_equals_the_reference_in_fp64(batch, groups, per_group, length, width, half):
    """Queries (B, G, g, T, d) and keys (B, G, T, d), strided, through one launch each way: features, dq, dk and
    both maps' weight gradients equal the definition's; 45 rows, 64 columns: ragged row blocks, two column blocks."""
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE)  # noqa: E731
    # as a layer hands them over: projections (B, T, heads, d) transposed, read in place
    q = make(batch, length, groups * per_group, width).transpose(1, 2).unflatten(1, (groups, per_group))
    k = make(batch, length, groups, width).transpose(1, 2)
    wq, wk = make(groups, width, half) / width ** 0.5, make(groups, width, half) / width ** 0.5
    g_q, g_k = make(batch, groups, per_group, length, 2 * half), make(batch, groups, length, 2 * half)
    results = {}
    for backend in ("torch", "triton"):
        inputs = [t.clone().requires_grad_() for t in (q, wq, k, wk)]
        phi_q, phi_k = hedgehog_pair(*inputs, backend=backend)
        grads = torch.autograd.grad((phi_q * g_q).sum() + (phi_k * g_k).sum(), inputs)
        results[backend] = (phi_q, phi_k, *grads)
    names = ("phi(q)", "phi(k)", "dq", "d W_q", "dk", "d W_k")
    for name, expected, actual in zip(names, results["torch"], results["triton"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14, msg=name)


def _hedgehog_fp32_inputs():
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 3, 20, 32, generator=generator), torch.randn(1, 2, 20, 32, generator=generator)
    wq, wk = torch.randn(2, 32, 32, generator=generator) / 6, torch.randn(2, 32, 32, generator=generator) / 6
    return q, wq, k, wk


@needs_kernels
def test_hedgehog_fp32_within_rounding():
    q, wq, k, wk = _hedgehog_fp32_inputs()
    exact = hedgehog(q.double(), wq.double()), hedgehog(k.double(), wk.double())
    fast = hedgehog_pair(*(t.to(DEVICE) for t in (q, wq, k, wk)), backend="triton")
    for expected, actual in zip(exact, fast):
        torch.testing.assert_close(actual.double().cpu(), expected, rtol=1e-5, atol=1e-7)


@interpreter_only  # the counter sees interpreted launches
def test_hedgehog_one_launch_each_way():
    inputs = [t.requires_grad_() for t in _hedgehog_fp32_inputs()]

    def step():
        phi_q, phi_k = hedgehog_pair(*inputs, backend="triton")
        (phi_q.pow(2).sum() + phi_k.sum()).backward()

    count, _ = count_ops(step)
    assert count.triton_launches == 2 and count.host_reads == 0, count.top()


def test_hedgehog_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"hedgehog: x must be \(B, G, ..., d\) and weight \(G, d, F / 2\)"):
        hedgehog(torch.zeros(1, 2, 5, 8), torch.zeros(3, 8, 4))


# --- the normalised read

@needs_kernels
@pytest.mark.parametrize("eps0,with_offset", [(1e-6, False), (0.0, False), (1e-6, True)],
                         ids=["hedgehog", "no_eps", "favor_offset"])
def test_normalised_read_equals_the_reference_in_fp64(eps0, with_offset):
    """The read as fla hands it over (a permuted view), some denominators 0 (an empty memory) or below eps0:
    output, log weight and the read's gradient equal the reference's."""
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE)  # noqa: E731
    read = make(2, 13, 3, 2, 9).permute(0, 2, 3, 1, 4)  # (B, G, g, T, dv + 1) from (B, T, G, g, dv + 1)
    read[..., -1] = read[..., -1].abs()
    read[0, :, :, :3] = 0  # empty memories: read 0, log weight log(tiny)
    read[1, 0, 0, :2, -1] = 1e-9  # a denominator below eps0
    offset = make(2, 3, 2, 13) if with_offset else None
    g_out, g_log = make(2, 3, 2, 13, 8), make(2, 3, 2, 13)
    results = {}
    for backend in ("torch", "triton"):
        leaf = read.clone().requires_grad_()
        out, log_weight = normalised_read(leaf, eps0, offset, backend=backend)
        results[backend] = (out, log_weight, *torch.autograd.grad((out * g_out).sum() + (log_weight * g_log).sum(),
                                                                  leaf))
    for name, expected, actual in zip(("out", "log weight", "d read"), results["torch"], results["triton"]):
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-14, msg=name)


# --- a converted layer

@needs_kernels
@pytest.mark.parametrize("combine", ["shared_normalizer", "sum"])
def test_a_vort_layer_on_the_kernel_equals_its_pytorch_path(combine):
    """A converted VORT layer (Hedgehog features, alpha routed by the window's entropy), left-padded, fp64: output and
    every parameter's gradient the same with its kernels (write weights, Hedgehog maps, normalised read, the shared
    combine) and on PyTorch."""
    from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings
    from hf_mixers.core.registry import get_mixer

    options = {**get_mixer("vort").conversion_options, "vort_window": 8, "vort_chunk_size": 8, "vort_combine": combine}
    results = {}
    for backend in ("torch", "auto"):  # auto: our kernels (fla and flex take no fp64 on a GPU: PyTorch there)
        torch.manual_seed(0)
        module, config = build_mixer("vort", {**options, "kernel_backend": backend}, 32, 4, 2, DEVICE, torch.float64)
        with torch.no_grad():  # alpha away from its init, so that tokens differ in order
            module.alpha_proj.weight.normal_(0, 0.3)
        x = torch.randn(2, 30, 32, dtype=torch.float64, device=DEVICE, requires_grad=True)
        mask = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
        mask[0, :7] = False
        out = module(x, rotary_embeddings(config, x, 30), None, mask)
        out.pow(2).sum().backward()
        results[backend] = [out.detach(), x.grad] + [p.grad for p in module.parameters()]
    for expected, actual in zip(results["torch"], results["auto"], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.variant  # a trace by dynamo and AOTAutograd: the full tier
@needs_kernels
def test_a_vort_layer_on_its_kernels_is_one_graph_for_torch_compile():
    """The write weights, Hedgehog, normalised-read and combine kernels are torch.library ops (forward and
    backward), so a converted VORT layer's training step on them compiles with ``fullgraph=True`` (a left-padded
    batch) and gives the eager output and input gradient."""
    from hf_mixers.core.registry import get_mixer

    torch.manual_seed(0)
    options = {**get_mixer("vort").conversion_options, "vort_window": 8, "vort_chunk_size": 8,
               "kernel_backend": "triton"}
    step, x, _ = padded_layer_step("vort", options, 32, 30)
    check_step_compiles_whole(step, x)
