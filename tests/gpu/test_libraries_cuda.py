"""The maintained libraries' CUDA kernels that kernels/dispatch.py hands work to, where carried, against ours:
flash-linear-attention's chunk_simple_gla and chunk_gla under the selective SSMs' scans, Liger-Kernel's fused
linear JSD + cross-entropy under the distillation loss, torch's flex_attention under the local windows. Their first
calls autotune and compile for minutes (the H100 run of 2026-11-27 spent its mixer tests' whole limit in fla's), so
`make gpu-check` runs this file last, in its own step.
"""

import pytest
import torch
from gpu_setup import DEVICE, ON_DEVICE, SHAPES, record, relative_error  # noqa: F401 (record: a fixture)

pytestmark = ON_DEVICE


def test_flash_linear_attention_gla_equals_our_scan(record):
    """mamba_ops.delta_t_scan on fla's chunk_gla (CUDA) against our chunked scan, values and gradients."""
    pytest.importorskip("fla")
    if DEVICE.type != "cuda":
        pytest.skip("flash-linear-attention's kernels need CUDA")
    from hf_mixers.kernels.mamba_ops import delta_t_scan

    g = torch.Generator().manual_seed(0)
    batch, length, heads, p, n = 2, 1024, 4, 64, 16

    def leaf(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(DEVICE).requires_grad_()

    x, dt, b, c = leaf(batch, length, heads, p), leaf(batch, length, heads, n), leaf(batch, length, 1, n, scale=0.3), \
        leaf(batch, length, 1, n, scale=0.3)
    a = (-torch.rand(heads, n, generator=g) - 0.5).to(DEVICE).requires_grad_()
    results = {}
    for backend in ("triton", "torch"):
        y, state = delta_t_scan(x, dt, a, b, c, dt_softplus=True, return_final_states=True, backend=backend)
        grads = torch.autograd.grad(y.pow(2).sum(), [x, dt, a, b, c])
        results[backend] = {"y": y, "state": state, **{f"d{k}": v for k, v in zip("x dt A B C".split(), grads)}}
    errors = {k: relative_error(results["triton"][k], results["torch"][k]) for k in results["torch"]}
    record(errors=errors)
    assert max(errors.values()) < 1e-2, f"fla chunk_gla vs our scan: {errors}"


def test_flash_linear_attention_simple_gla_under_ssd_equals_our_scan(record):
    """mamba_ops.ssd_scan (Mamba-2, as the selective SSM converts) on fla's chunk_simple_gla (CUDA, without
    mamba_ssm) against our chunked scan, values, final state and gradients, B and C shared by a group of heads."""
    pytest.importorskip("fla")
    if DEVICE.type != "cuda":
        pytest.skip("fla's kernels need CUDA (against its naive reference: tests/unit/test_selective_scan.py)")
    from hf_mixers.kernels.mamba_ops import ssd_scan

    g = torch.Generator().manual_seed(0)
    batch, length, heads, p, n = 2, 1024, 8, 64, 64

    def leaf(*size, scale=1.0, shift=0.0):
        return (torch.randn(*size, generator=g) * scale + shift).to(DEVICE).requires_grad_()

    x, dt, b, c = leaf(batch, length, heads, p), leaf(batch, length, heads, shift=-2.0), \
        leaf(batch, length, 2, n, scale=0.1), leaf(batch, length, 2, n, scale=0.1)
    a, h0 = leaf(heads, scale=0.1, shift=-1.0), leaf(batch, heads, p, n, scale=0.1)
    results = {}
    for backend in ("triton", "torch"):
        y, state = ssd_scan(x, dt, a, b, c, 64, dt_softplus=True, initial_states=h0, return_final_states=True,
                            backend=backend)
        grads = torch.autograd.grad(y.pow(2).sum() + state.pow(2).sum(), [x, dt, a, b, c, h0])
        results[backend] = {"y": y, "state": state, **{f"d{k}": v for k, v in zip("x dt A B C h0".split(), grads)}}
    errors = {k: relative_error(results["triton"][k], results["torch"][k]) for k in results["torch"]}
    record(errors=errors)
    assert max(errors.values()) < 1e-2, f"fla chunk_simple_gla vs our scan: {errors}"


def test_flash_linear_attention_simple_gla_under_vort_retention_equals_the_chunked_form(record):
    """kernels/retention.retention (VORT's global branch) on fla's chunk_simple_gla with a constant decay a head
    (g_gamma), one head a (KV head, slot, query head), against the chunked form: SmolLM2's heads, 16 slots of the
    SOE rates, 64 features, the normaliser's column of ones, a starting state; values, state and gradients."""
    pytest.importorskip("fla")
    if DEVICE.type != "cuda":
        pytest.skip("fla's kernels need CUDA (against its naive reference: tests/unit/test_retention.py)")
    from hf_mixers.kernels.retention import retention, retention_chunked
    from hf_mixers.kernels.soe import soe_log_rates, soe_weights

    g = torch.Generator().manual_seed(0)
    batch, groups, per_group, length, features, width, terms = 2, 3, 3, 1024, 64, 65, 15
    weights, skip = soe_weights(0.1 + 0.9 * torch.rand(batch, groups, length, generator=g), terms, 2048)
    inputs = {"q": torch.rand(batch, groups, per_group, length, features, generator=g) / features,
              "k": torch.rand(batch, groups, length, features, generator=g),
              "v": torch.randn(batch, groups, length, width, generator=g), "weights": weights, "skip": skip,
              "state": torch.randn(batch, groups, terms + 1, features, width, generator=g) * 0.01}
    log_rates = soe_log_rates(terms, 2048)[None].to(DEVICE)
    results = {}
    for name, run in (("fla", lambda **a: retention(**a, backend="triton")), ("chunked", retention_chunked)):
        leaves = {key: t.to(DEVICE).requires_grad_() for key, t in inputs.items()}
        out, state = run(**leaves, log_rates=log_rates)
        grads = torch.autograd.grad(out.pow(2).sum() + state.pow(2).sum(), list(leaves.values()))
        results[name] = {"out": out, "state": state, **{f"d{key}": grad for key, grad in zip(leaves, grads)}}
    errors = {k: relative_error(results["fla"][k], results["chunked"][k]) for k in results["chunked"]}
    record(errors=errors)
    assert max(errors.values()) < 1e-2, f"fla chunk_simple_gla vs the chunked retention: {errors}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_distillation_loss_equals_the_chunked_loss(dtype, record):
    """kernels/distill_loss.distillation_loss on CUDA dispatches to Liger-Kernel's fused linear JSD + cross-entropy
    (where carried); at SmolLM2's head (hidden 576, vocabulary 49,152) over 2,048 rows it equals the chunked PyTorch
    loss, values and the gradient of the student's hidden states, and its peak memory is recorded beside it."""
    pytest.importorskip("liger_kernel")
    if DEVICE.type != "cuda":
        pytest.skip("Liger-Kernel's kernels need CUDA (the interpreter test is tests/unit/test_distill_loss_liger.py)")
    from hf_mixers.kernels.distill_loss import IGNORE, distillation_loss

    g = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 2048, 576, 49152
    h_s = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype).requires_grad_()
    w_s = (0.05 * torch.randn(vocab, hidden, generator=g)).to(DEVICE, dtype)
    h_t = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    w_t = (0.05 * torch.randn(vocab, hidden, generator=g)).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    targets[-1] = IGNORE
    results, peaks = {}, {}
    for backend in ("triton", "torch"):  # "triton": the library kernel, or an error saying why it cannot run
        h_s.grad = None
        torch.cuda.reset_peak_memory_stats()
        loss, kl, ce = distillation_loss(h_s, w_s, h_t, w_t, targets, 2.0, 0.5, 512, backend=backend)
        loss.backward()
        peaks[backend] = torch.cuda.max_memory_allocated() / 2**20
        results[backend] = {"loss": loss.detach(), "kl": kl, "ce": ce, "grad": h_s.grad.clone()}
    errors = {k: relative_error(results["triton"][k], results["torch"][k]) for k in results["torch"]}
    record(errors=errors, peak_mib_liger=round(peaks["triton"], 1), peak_mib_chunked=round(peaks["torch"], 1))
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 2e-2), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_flex_attention_window_equals_the_block_form(shape_name, dtype, record):
    """kernels/local_attention.local_attention on CUDA takes flex_attention (compiled once; the band as a block mask,
    padding as a score_mod, the entropy from the keys appended to the values): at the model's heads, w = 64, 2,048
    tokens, a left-padded row, it equals the PyTorch block form in fp64 on the same rounded inputs, values and
    gradients."""
    if DEVICE.type != "cuda":
        pytest.skip("flex_attention's fused kernel needs CUDA (its CPU form: tests/unit/test_local_attention.py)")
    from hf_mixers.kernels.local_attention import local_attention

    shape, window, length = SHAPES[shape_name], 64, 2048
    groups, per_group, dim = shape["kv_heads"], shape["heads"] // shape["kv_heads"], shape["head_dim"]
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, groups, per_group, length, dim, generator=g),
              *(torch.randn(2, groups, window + length, dim, generator=g) for _ in "kv")]
    valid = torch.ones(2, window + length, dtype=torch.bool)
    valid[:, :window] = False
    valid[0, :window + 300] = False
    probes = [torch.randn(2, groups, per_group, length, *rest, generator=g) for rest in ((dim,), (), ())]
    results = {}
    for backend, run_dtype in (("auto", dtype), ("torch", torch.float64)):
        tensors = [t.to(dtype).to(DEVICE, run_dtype).requires_grad_() for t in leaves]
        outputs = local_attention(*tensors, valid.to(DEVICE), window, dim ** -0.5, with_entropy=True, backend=backend)
        real = valid[:, window:].to(DEVICE)[:, None, None]
        loss = sum((out.double() * probe.to(DEVICE, torch.float64) * (real[..., None] if out.dim() == 5 else real)
                    ).sum() for out, probe in zip(outputs, probes))
        grads = torch.autograd.grad(loss, tensors)
        keep = valid[:, window:].to(DEVICE)
        results[backend] = {**{name: out.movedim(3, 1)[keep] for name, out in zip(("out", "log_z", "entropy"),
                                                                                   outputs)},
                            **{f"d{name}": grad for name, grad in zip("qkv", grads)}}
    errors = {name: relative_error(results["auto"][name], results["torch"][name]) for name in results["torch"]}
    bound = 2e-3 if dtype == torch.float32 else 2e-2
    record(shape=shape_name, dtype=str(dtype), errors=errors, bound=bound)
    assert max(errors.values()) < bound, f"flex_attention window vs the block form: {errors}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_over_a_gltm_pattern_equals_the_gathered_form(dtype, record):
    """kernels/sparse_attention.sparse_attention on CUDA with a shared table takes flex_attention (compiled once; the
    table as its mask_mod, the key blocks it touches as its block mask): GLTM's A-branch with pow2_ce at 2,048 tokens
    and the 8B model's heads equals the gathered form in fp64 on the same rounded inputs, values and gradients."""
    if DEVICE.type != "cuda":
        pytest.skip("flex_attention's fused kernel needs CUDA (its CPU form: tests/unit/test_sparse_attention.py)")
    from hf_mixers.kernels.sparse_attention import sparse_attention
    from hf_mixers.kernels.token_patterns import support_rows

    shape, length = SHAPES["llama3-8b"], 2048
    per_group, dim = shape["heads"] // shape["kv_heads"], shape["head_dim"]
    positions = torch.arange(1, length + 1)
    table = (torch.cat([positions[:, None], support_rows("pow2_ce", positions)], -1) - 1).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, length, per_group, dim, generator=g), torch.randn(2, length, dim, generator=g),
              torch.randn(2, length, dim, generator=g)]
    probe = torch.randn(2, length, per_group, dim, generator=g).to(DEVICE, torch.float64)
    results = {}
    for backend, run_dtype, shared in (("auto", dtype, ("gpu test", length)), ("torch", torch.float64, None)):
        tensors = [t.to(dtype).to(DEVICE, run_dtype).requires_grad_() for t in leaves]
        out = sparse_attention(*tensors, table.expand(2, -1, -1), dim ** -0.5, shared=shared, backend=backend)
        grads = torch.autograd.grad((out.double() * probe).sum(), tensors)
        results[backend] = {"out": out, **{f"d{name}": grad for name, grad in zip("qkv", grads)}}
    errors = {name: relative_error(results["auto"][name], results["torch"][name]) for name in results["torch"]}
    bound = 2e-3 if dtype == torch.float32 else 2e-2
    record(dtype=str(dtype), errors=errors, bound=bound)
    assert max(errors.values()) < bound, f"flex_attention over pow2_ce vs the gathered form: {errors}"
