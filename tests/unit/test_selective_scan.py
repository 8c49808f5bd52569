"""kernels/selective_scan.py and hf_mixers.ops: every form of the selective scan against the token recurrence in fp64,
and the functional ops against transformers' own PyTorch Mamba / Mamba-2 references."""

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba.modeling_mamba import mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan, mamba2_selective_state_update

from hf_mixers.kernels import dispatch
from hf_mixers.kernels.selective_scan import ssm_chunked, ssm_factored, ssm_recurrent, ssm_step
from hf_mixers.ops import delta_t_scan, selective_scan, ssd_scan

F64 = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-10)
FP32 = dict(rtol=1e-4, atol=1e-5)  # transformers' references cast u, B, C to fp32 (.float()) whatever their dtype
# (Pd, Nd): the decay's shape per head: Mamba-2, Mamba-Δᵀ with A per slot, S6 / S4D, a decay per channel only
DECAYS = [(1, 1), (1, 5), (3, 5), (3, 1)]


def inputs(Pd, Nd, batch=2, length=37, heads=4, width=3, size=5, groups=2, seed=0, strength=2.0):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=F64)  # noqa: E731
    log_decay = -strength * torch.rand(batch, length, heads, Pd, Nd, generator=generator, dtype=F64)
    return (randn(batch, length, heads, width), log_decay, randn(batch, length, groups, size),
            randn(batch, length, groups, size), randn(batch, heads, width, size))


@pytest.mark.parametrize("Pd,Nd", DECAYS)
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunked_equals_the_recurrence(Pd, Nd, chunk_size):
    u, log_decay, B, C, state = inputs(Pd, Nd)
    expected, expected_state = ssm_recurrent(u, log_decay, B, C, state)
    for intra in ("auto", "scan") + (("matmul",) if Pd == 1 else ()):
        y, final = ssm_chunked(u, log_decay, B, C, state, chunk_size, intra)
        torch.testing.assert_close(y, expected, **EXACT, msg=f"intra={intra}")
        torch.testing.assert_close(final, expected_state, **EXACT, msg=f"intra={intra}")


@pytest.mark.parametrize("Pd,Nd", DECAYS)
def test_gradients_of_the_chunked_form_equal_the_recurrence(Pd, Nd):
    tensors = [t.requires_grad_() for t in inputs(Pd, Nd, length=13)]
    grads = []
    for form in (lambda *t: ssm_recurrent(*t), lambda *t: ssm_chunked(*t, chunk_size=4)):
        y, state = form(*tensors)
        grads.append(torch.autograd.grad(y.pow(2).sum() + state.pow(2).sum(), tensors))
    for name, chunked, recurrent in zip(("u", "log_decay", "B", "C", "state"), grads[1], grads[0]):
        torch.testing.assert_close(chunked, recurrent, **EXACT, msg=name)


@pytest.mark.parametrize("Pd,Nd", DECAYS)
def test_decode_steps_and_a_prefill_in_chunks_continue_one_state(Pd, Nd):
    u, log_decay, B, C, state = inputs(Pd, Nd, groups=4)
    full, full_state = ssm_chunked(u, log_decay, B, C, state, chunk_size=8)
    first, middle = ssm_chunked(u[:, :20], log_decay[:, :20], B[:, :20], C[:, :20], state, chunk_size=8)
    second, middle = ssm_chunked(u[:, 20:30], log_decay[:, 20:30], B[:, 20:30], C[:, 20:30], middle, chunk_size=8)
    steps = []
    for t in range(30, u.shape[1]):  # then token by token on the constant-size state
        y, middle = ssm_step(middle, u[:, t], log_decay[:, t], B[:, t], C[:, t])
        steps.append(y[:, None])
    torch.testing.assert_close(torch.cat([first, second, *steps], dim=1), full, **EXACT)
    torch.testing.assert_close(middle, full_state, **EXACT)


def test_a_step_with_no_write_and_no_decay_is_a_no_op():
    u, log_decay, B, C, state = inputs(3, 5, length=9)
    u[:, 4], log_decay[:, 4] = 0.0, 0.0  # a padded position
    y, final = ssm_chunked(u, log_decay, B, C, state, chunk_size=4)
    keep = [t for t in range(9) if t != 4]
    y_alone, final_alone = ssm_recurrent(u[:, keep], log_decay[:, keep], B[:, keep], C[:, keep], state)
    torch.testing.assert_close(final, final_alone, **EXACT)
    torch.testing.assert_close(y[:, keep], y_alone, **EXACT)


def test_low_precision_inputs_accumulate_in_fp32():
    u, log_decay, B, C, _ = (t.to(torch.bfloat16) for t in inputs(1, 1, length=70, strength=0.01))
    y, state = ssm_chunked(u, log_decay, B, C)
    assert y.dtype == state.dtype == torch.float32
    exact, _ = ssm_recurrent(*(t.double() for t in (u, log_decay, B, C)))
    assert ((y.double() - exact).norm() / exact.norm()) < 1e-5  # bf16 inputs, fp32 accumulation: no drift over T


def test_bad_shapes_are_named():
    u, log_decay, B, C, state = inputs(1, 1)
    with pytest.raises(ValueError, match=r"B must be \(batch, length, groups, state\) with groups dividing 4 heads"):
        ssm_chunked(u, log_decay, B[:, :, :1].expand(-1, -1, 3, -1), C)
    with pytest.raises(ValueError, match=r"log_decay must be \(batch, length, heads, 1 or 3, 1 or 5\)"):
        ssm_chunked(u, log_decay.expand(-1, -1, -1, 2, 1), B, C)
    with pytest.raises(ValueError, match=r"state must be \(2, 4, 3, 5\)"):
        ssm_chunked(u, log_decay, B, C, state[:, :, :2])
    with pytest.raises(ValueError, match="the matmul form needs a decay shared by the head's channels"):
        ssm_chunked(*inputs(3, 5)[:4], intra="matmul")


# ---- hf_mixers.ops against transformers' PyTorch references of mamba_ssm's ops -------------------------------------

def mamba_inputs(batch=2, dim=6, size=4, length=23, seed=3):
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=F64)  # noqa: E731
    return dict(u=randn(batch, dim, length), delta=randn(batch, dim, length), A=-torch.rand(dim, size, dtype=F64,
                generator=generator) * 3, B=randn(batch, size, length), C=randn(batch, size, length), D=randn(dim),
                z=randn(batch, dim, length), delta_bias=randn(dim))


def test_selective_scan_equals_transformers_mamba_reference():
    args = mamba_inputs()
    expected, expected_state = mamba_selective_scan(args["u"], args["delta"], args["A"], args["B"], args["C"],
                                                    args["D"], args["z"], args["delta_bias"], True,
                                                    return_last_state=True)
    out, state = selective_scan(**args, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(out, expected, **FP32)
    torch.testing.assert_close(state, expected_state, **FP32, check_dtype=False)


def test_selective_scan_with_groups_and_constant_B_C_follows_the_definition():
    args = mamba_inputs(dim=6, size=4)
    batch, dim, length = args["u"].shape
    B_groups = torch.randn(batch, 2, 4, length, dtype=F64)  # channels 0-2 read group 0, 3-5 group 1
    C_const = torch.randn(dim, 4, dtype=F64)
    out = selective_scan(args["u"], args["delta"], args["A"], B_groups, C_const, delta_softplus=True)
    delta = F.softplus(args["delta"])
    state, expected = torch.zeros(batch, dim, 4, dtype=F64), []
    B_channel = B_groups.repeat_interleave(3, dim=1)  # (batch, dim, N, L)
    for t in range(length):  # the definition (mamba_ssm's selective_scan_ref)
        state = torch.exp(delta[:, :, t, None] * args["A"]) * state \
            + (delta[:, :, t] * args["u"][:, :, t])[..., None] * B_channel[..., t]
        expected.append((state * C_const).sum(-1))
    torch.testing.assert_close(out, torch.stack(expected, -1), **EXACT)


@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_scan_equals_transformers_mamba2_reference(groups):
    generator = torch.Generator().manual_seed(5)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=F64)  # noqa: E731
    batch, length, heads, width, size = 2, 29, 4, 3, 5
    x, dt, B, C = randn(batch, length, heads, width), randn(batch, length, heads), randn(batch, length, groups,
                                                                                        size), randn(batch, length,
                                                                                                     groups, size)
    A, D, dt_bias, initial = -torch.rand(heads, dtype=F64) * 2, randn(heads), randn(heads), randn(batch, heads,
                                                                                                   width, size)
    expected, expected_state = mamba2_chunk_scan(x, dt, A, B, C, 8, D=D, dt_bias=dt_bias, initial_states=initial,
                                                 dt_softplus=True, return_final_states=True)
    out, state = ssd_scan(x, dt, A, B, C, 8, D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=initial,
                          return_final_states=True)
    torch.testing.assert_close(out, expected, **FP32)
    torch.testing.assert_close(state, expected_state, **FP32, check_dtype=False)
    # transformers' one-token update (mamba_ssm's selective_state_update) continues our final state
    step_x, step_dt, step_B, step_C = randn(batch, heads, width), randn(batch, heads), randn(batch, groups, size), \
        randn(batch, groups, size)
    reference_state = state.clone()
    expected_step = mamba2_selective_state_update(reference_state, step_x, step_dt[..., None].expand(-1, -1, width),
                                                  A[:, None, None].expand(
        heads, width, size), step_B, step_C, D=D[:, None].expand(heads, width), dt_bias=dt_bias[:, None].expand(
        heads, width), dt_softplus=True)
    step, step_state = ssd_scan(step_x[:, None], step_dt[:, None], A, step_B[:, None], step_C[:, None], 8, D=D,
                                dt_bias=dt_bias, dt_softplus=True, initial_states=state, return_final_states=True)
    torch.testing.assert_close(step[:, 0], expected_step, **FP32)
    torch.testing.assert_close(step_state, reference_state, **FP32)


@pytest.mark.parametrize("full_A", [False, True])
@pytest.mark.parametrize("input_scaling", ["none", "state"])
def test_delta_t_scan_is_eq_15_and_gated_linear_attention(full_A, input_scaling):
    generator = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=F64)  # noqa: E731
    batch, length, heads, width, size = 2, 19, 2, 3, 4
    x, dt, B, C = randn(batch, length, heads, width), randn(batch, length, heads, size), randn(batch, length, 1,
                                                                                               size), randn(
        batch, length, 1, size)
    A = -torch.rand(*((heads, width, size) if full_A else (heads, size)), dtype=F64, generator=generator) * 2
    out, final = delta_t_scan(x, dt, A, B, C, chunk_size=4, dt_softplus=True, return_final_states=True,
                              input_scaling=input_scaling)
    delta = F.softplus(dt)
    # eq. 15 token by token: h[p, n] = exp(A[p, n] Δ[n]) h[p, n] + x[p] B[n]   (GLA: S = diag(α) S + k v^T, o = q S)
    state, expected = torch.zeros(batch, heads, width, size, dtype=F64), []
    for t in range(length):
        decay = torch.exp((A if full_A else A[:, None, :]) * delta[:, t, :, None, :])
        key = B[:, t] * (delta[:, t] if input_scaling == "state" else 1.0)
        state = decay * state + x[:, t, :, :, None] * key[:, :, None, :]
        expected.append(torch.einsum("bhpn,bn->bhp", state, C[:, t, 0]))
    torch.testing.assert_close(out, torch.stack(expected, 1), **EXACT)
    torch.testing.assert_close(final, state, **EXACT)


# ---- dispatch to the maintained CUDA kernels --------------------------------------------------------------------

@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_announced", set())
    monkeypatch.setattr(dispatch, "_installed", {})  # what a test's patched find_spec says is not kept
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)


def test_library_kernels_run_only_on_cuda_and_are_named_once(fresh_dispatch, monkeypatch, caplog):
    fake = types.ModuleType("mamba_ssm_fake")
    fake.scan = lambda *args: "library"
    monkeypatch.setitem(sys.modules, "mamba_ssm_fake", fake)
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: object())
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        assert dispatch.library_kernel("ssd", "mamba_ssm_fake", "scan", cuda)() == "library"
        assert dispatch.library_kernel("ssd", "mamba_ssm_fake", "scan", cuda)() == "library"
        assert dispatch.library_kernel("ssd", "mamba_ssm_fake", "scan", torch.device("cpu")) is None
        assert dispatch.library_kernel("ssd", "mamba_ssm_fake", "scan", cuda, "torch") is None
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ["hf_mixers: ssd runs on the mamba_ssm_fake kernel mamba_ssm_fake.scan",
                     "hf_mixers: ssd runs on the PyTorch path (tensors on cpu (the mamba_ssm_fake kernel needs CUDA))",
                     "hf_mixers: ssd runs on the PyTorch path (forced by kernel_backend='torch')"]
    with pytest.raises(RuntimeError, match=r"ssd: the fast kernel was requested \(kernel_backend='triton'\) but "
                                           r"cannot run: mamba_ssm_fake.missing cannot be imported"):
        dispatch.library_kernel("ssd", "mamba_ssm_fake", "missing", cuda, "triton")


def test_the_ops_hand_the_library_mamba_ssm_arguments(fresh_dispatch, monkeypatch):
    calls = []
    monkeypatch.setattr("hf_mixers.kernels.mamba_ops.installed", lambda package: True)  # mamba_ssm, before fla
    monkeypatch.setattr("hf_mixers.kernels.mamba_ops.library_kernel",
                        lambda kernel, module, attribute, device, backend, check: (
                            lambda *a, **k: calls.append((attribute, a, k))))
    args = mamba_inputs()
    selective_scan(**args, delta_softplus=True)
    assert calls[-1][0] == "selective_scan_fn" and calls[-1][1][0] is args["u"] and calls[-1][1][8] is True
    x = torch.randn(1, 4, 2, 3)
    ssd_scan(x, torch.randn(1, 4, 2), -torch.ones(2), torch.randn(1, 4, 1, 5), torch.randn(1, 4, 1, 5), 8,
             dt_softplus=True)
    assert calls[-1][0] == "mamba_chunk_scan_combined" and calls[-1][2]["dt_softplus"] is True


@pytest.mark.parametrize("groups", [1, 2])
def test_ssd_scan_through_flash_linear_attention_equals_our_scan(groups, fresh_dispatch):
    """Without mamba_ssm, SSD on CUDA is fla's chunk_simple_gla (q = C, k = B, v = Δ x, g = Δ A, its state (N, P)):
    with fla's own naive recurrence in the kernel's place (its kernels need CUDA), the output, the final state and
    every gradient are our chunked scan's (B and C shared by 1 or 2 groups of 4 heads, a starting state, D and z)."""
    from hf_mixers.apps.bench.op_count import _simple_gla_reference

    g = torch.Generator().manual_seed(0)
    batch, length, heads, width, size = 2, 50, 4, 8, 16
    leaves = {"x": torch.randn(batch, length, heads, width, generator=g),
              "dt": torch.randn(batch, length, heads, generator=g),
              "A": -torch.rand(heads, generator=g) - 0.5,
              "B": 0.3 * torch.randn(batch, length, groups, size, generator=g),
              "C": 0.3 * torch.randn(batch, length, groups, size, generator=g),
              "initial_states": torch.randn(batch, heads, width, size, generator=g),
              "D": torch.randn(heads, generator=g), "z": torch.randn(batch, length, heads, width, generator=g)}
    calls, results = [], {}
    for path, stand_ins in (("ours", {}), ("fla", {"fla.ops.simple_gla.chunk_simple_gla": lambda *a, **k: (
            calls.append(k["scale"]) or _simple_gla_reference(*a, **k))})):
        tensors = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        with dispatch.library_stand_ins(stand_ins):
            out, state = ssd_scan(chunk_size=16, dt_softplus=True, return_final_states=True, **tensors)
        grads = torch.autograd.grad(out.pow(2).sum() + state.pow(2).sum(), list(tensors.values()))
        results[path] = [out, state, *grads]
    assert calls == [1.0]
    for name, got, want in zip(["out", "state", *leaves], results["fla"], results["ours"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("input_scaling", ["none", "state"])
def test_delta_t_scan_through_flash_linear_attention_equals_our_scan(input_scaling, fresh_dispatch):
    """Mamba-Δᵀ with A per slot on CUDA is fla's chunk_gla (q = C, k = B, v = x, g = Δ A per key slot, scale 1):
    with fla's own naive recurrence in the kernel's place, output, final state and gradients are our scan's."""
    from hf_mixers.apps.bench.op_count import _gla_reference

    g = torch.Generator().manual_seed(0)
    batch, length, heads, width, size = 2, 40, 4, 8, 16
    leaves = {"x": torch.randn(batch, length, heads, width, generator=g),
              "dt": torch.randn(batch, length, heads, size, generator=g),
              "A": -torch.rand(heads, size, generator=g) - 0.5,
              "B": 0.3 * torch.randn(batch, length, 2, size, generator=g),
              "C": 0.3 * torch.randn(batch, length, 2, size, generator=g),
              "initial_states": torch.randn(batch, heads, width, size, generator=g)}
    calls, results = [], {}
    for path, stand_ins in (("ours", {}), ("fla", {"fla.ops.gla.chunk_gla": lambda *a, **k: (
            calls.append(k["scale"]) or _gla_reference(*a, **k))})):
        tensors = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        with dispatch.library_stand_ins(stand_ins):
            out, state = delta_t_scan(chunk_size=16, dt_softplus=True, return_final_states=True,
                                      input_scaling=input_scaling, **tensors)
        grads = torch.autograd.grad(out.pow(2).sum() + state.pow(2).sum(), list(tensors.values()))
        results[path] = [out, state, *grads]
    assert calls == [1.0]
    for name, got, want in zip(["out", "state", *leaves], results["fla"], results["ours"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_auto_picks_the_factored_recurrence_only_for_large_per_channel_states(monkeypatch):
    from hf_mixers.kernels import selective_scan as scan

    calls = []
    for name in ("ssm_recurrent", "ssm_chunked", "ssm_factored"):
        original = getattr(scan, name)
        monkeypatch.setattr(scan, name, lambda *a, _name=name, _original=original, **k:
                            calls.append(_name) or _original(*a, **k))
    # (delta's Pd, Nd, A's Pa, Na, width, size): S6 (Δ per channel, A per channel and slot), Δᵀ with A per slot,
    # the paper's small per-channel state, Mamba-2
    for Pd, Nd, Pa, Na, width, size, expected in ((64, 1, 64, 64, 64, 64, "ssm_factored"),
                                                  (1, 64, 1, 64, 64, 64, "ssm_chunked"),
                                                  (32, 1, 32, 8, 32, 8, "ssm_chunked"),
                                                  (1, 1, 1, 1, 64, 64, "ssm_chunked")):
        u = torch.zeros(1, 8, 16, width, dtype=F64)  # 16 heads: B H P N = 65536 for the first
        scan.ssm_scan(u, torch.zeros(1, 8, 16, Pd, Nd, dtype=F64), -torch.ones(16, Pa, Na, dtype=F64),
                      torch.zeros(1, 8, 1, size, dtype=F64), torch.zeros(1, 8, 1, size, dtype=F64))
        assert calls[-1] == expected, (Pd, Nd, Pa, Na, width, size)
    scan.ssm_scan(u[:, :1], torch.zeros(1, 1, 16, 1, 1, dtype=F64), -torch.ones(16, 1, 1, dtype=F64),
                  torch.zeros(1, 1, 1, 64, dtype=F64), torch.zeros(1, 1, 1, 64, dtype=F64))
    assert calls[-1] == "ssm_recurrent"  # one token: the decode step
    with pytest.raises(ValueError, match="unknown method"):
        scan.ssm_scan(u, torch.zeros(1, 8, 16, 1, 1, dtype=F64), -torch.ones(16, 1, 1, dtype=F64),
                      torch.zeros(1, 8, 1, 64, dtype=F64), torch.zeros(1, 8, 1, 64, dtype=F64), method="fast")


# (delta's shape per head, A's shape per head): S6 (Δ per channel, A per channel and slot), Δᵀ with a full A (Δ per
# slot), S4D (Δ = 1, A per channel and slot), a per-channel-and-slot Δ with A per head, Δᵀ with A per slot
FACTORS = [((3, 1), (3, 5)), ((1, 5), (3, 5)), ((1, 1), (3, 5)), ((3, 5), (1, 1)), ((1, 5), (1, 5))]


def factored_inputs(delta_shape, a_shape, length=13, seed=0):
    u, _, B, C, state = inputs(1, 1, length=length, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    delta = torch.rand(2, length, 4, *delta_shape, generator=generator, dtype=F64)
    A = -2.0 * torch.rand(4, *a_shape, generator=generator, dtype=F64)
    return u, delta, A, B, C, state


@pytest.mark.parametrize("delta_shape,a_shape", FACTORS)
@pytest.mark.parametrize("segment", [1, 4, 64])
def test_the_factored_recurrence_and_its_gradients_equal_the_recurrence(delta_shape, a_shape, segment):
    """The hand-written backward (states recomputed per segment) against autograd through the definition."""
    tensors = [t.requires_grad_() for t in factored_inputs(delta_shape, a_shape)]
    u, delta, A, B, C, state = tensors
    results = []
    for y, final in (ssm_recurrent(u, delta * A, B, C, state), ssm_factored(*tensors, segment=segment)):
        results.append((y, final, torch.autograd.grad(y.pow(2).sum() + final.pow(3).sum(), tensors)))
    (y_ref, state_ref, grads_ref), (y, final, grads) = results
    torch.testing.assert_close(y, y_ref, **EXACT)
    torch.testing.assert_close(final, state_ref, **EXACT)
    for name, got, expected in zip(("u", "delta", "A", "B", "C", "state"), grads, grads_ref):
        torch.testing.assert_close(got, expected, **EXACT, msg=name)


def test_the_factored_recurrence_passes_gradcheck_and_rejects_bad_shapes():
    tensors = [t.requires_grad_() for t in factored_inputs((3, 1), (3, 5), length=6)]
    assert torch.autograd.gradcheck(lambda *t: ssm_factored(*t, segment=4), tensors)
    u, delta, A, B, C, state = factored_inputs((3, 1), (3, 5))
    with pytest.raises(ValueError, match="delta must be"):
        ssm_factored(u, delta[..., 0], A, B, C, state)
    with pytest.raises(ValueError, match="do not broadcast"):
        ssm_factored(u, delta, -torch.ones(4, 2, 5, dtype=F64), B, C, state)
