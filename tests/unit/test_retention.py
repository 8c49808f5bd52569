"""Multi-rate retention (kernels/retention.py): the quadratic definition, the token recurrence (decode) and the
chunked form agree in fp64, values and gradients; the paper's K routed banks collapse exactly into one set of slots."""

import pytest
import torch

from hf_mixers.kernels.retention import retention_chunked, retention_quadratic, retention_recurrent
from hf_mixers.kernels.soe import soe_log_rates, soe_weights

TERMS, HORIZON = 6, 64


def inputs(batch=2, groups=2, per_group=3, length=13, features=5, width=4, seed=0, per_group_rates=False):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    alpha = 0.1 + 0.9 * rand(batch, groups, length)
    alpha[0, 0, 3] = 1.0  # the exact no-decay order takes part
    weights, skip = soe_weights(alpha, TERMS, HORIZON)
    weights[1, :, 5] = 0  # a padded token writes nothing
    log_rates = soe_log_rates(TERMS, HORIZON)[None]
    if per_group_rates:  # learned rates per KV head (the exp / mixture kernels)
        log_rates = -rand(groups, TERMS + 1)
    return dict(q=rand(batch, groups, per_group, length, features), k=rand(batch, groups, length, features),
                v=torch.randn(batch, groups, length, width, generator=generator, dtype=torch.float64),
                log_rates=log_rates, weights=weights, skip=skip,
                state=torch.randn(batch, groups, TERMS + 1, features, width, generator=generator, dtype=torch.float64))


@pytest.mark.parametrize("include_current", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("per_group_rates", [False, True])
def test_three_forms_agree(include_current, with_state, per_group_rates):
    x = inputs(per_group_rates=per_group_rates)
    if not with_state:
        x["state"] = None
    expected, expected_state = retention_quadratic(**x, include_current=include_current)
    forms = {"recurrent": retention_recurrent(**x, include_current=include_current)}
    for chunk in (1, 4, 5, 13, 64):
        forms[f"chunk {chunk}"] = retention_chunked(**x, include_current=include_current, chunk_size=chunk)
    for name, (out, state) in forms.items():
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("chunks_per_segment", [1, 2])
@pytest.mark.parametrize("include_current, with_state", [(True, False), (False, True)])
def test_a_long_input_goes_a_segment_at_a_time_with_the_same_values_and_gradients(
        chunks_per_segment, include_current, with_state, monkeypatch):
    import hf_mixers.kernels.retention as module

    x = inputs(length=13)
    if not with_state:
        x["state"] = None
    names = ("q", "k", "v", "weights") + (("skip",) if include_current else ()) + (("state",) if with_state else ())
    leaves = {name: x[name].clone().requires_grad_(True) for name in names}
    expected, expected_state = retention_quadratic(**{**x, **leaves}, include_current=include_current)
    want = torch.autograd.grad(expected.sin().sum() + expected_state.cos().sum(), list(leaves.values()))
    per_chunk = 2 * 2 * 7 * 4 * max(3 * 4, 5)  # B G S V max(g C, F) with chunks of 4
    monkeypatch.setattr(module, "SEGMENT_ELEMENTS", chunks_per_segment * per_chunk)
    calls, real = [], module.retention_chunked
    monkeypatch.setattr(module, "retention_chunked", lambda q, *a, **k: calls.append(q.shape[3]) or real(q, *a, **k))
    out, state = module.retention_chunked(**{**x, **leaves}, include_current=include_current, chunk_size=4)
    segment = 4 * chunks_per_segment
    assert calls == [13] + [min(segment, 13 - start) for start in range(0, 13, segment)]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-12)
    got = torch.autograd.grad(out.sin().sum() + state.cos().sum(), list(leaves.values()))
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_chunked_gradients_equal_the_definition():
    x = inputs(length=11)
    names = ("q", "k", "v", "weights", "skip", "state")
    grads = {}
    for form in ("quadratic", "chunked"):
        leaves = {name: x[name].clone().requires_grad_(True) for name in names}
        run = retention_quadratic if form == "quadratic" else \
            (lambda **a: retention_chunked(**a, chunk_size=4))
        out, state = run(**{**x, **leaves})
        (out.sin().sum() + state.cos().sum()).backward()
        grads[form] = {name: leaf.grad for name, leaf in leaves.items()}
    for name in names:
        torch.testing.assert_close(grads["chunked"][name], grads["quadratic"][name], rtol=0, atol=1e-11, msg=name)


def test_prefill_then_steps_equals_one_call():
    x = inputs(length=12)
    whole, final = retention_chunked(**x, chunk_size=4)
    head = {**x, "q": x["q"][:, :, :, :7], "k": x["k"][:, :, :7], "v": x["v"][:, :, :7],
            "weights": x["weights"][:, :, :7], "skip": x["skip"][:, :, :7]}
    out, state = retention_chunked(**head, chunk_size=4)
    outs = [out]
    for t in range(7, 12):
        step = {**x, "q": x["q"][:, :, :, t:t + 1], "k": x["k"][:, :, t:t + 1], "v": x["v"][:, :, t:t + 1],
                "weights": x["weights"][:, :, t:t + 1], "skip": x["skip"][:, :, t:t + 1], "state": state}
        out, state = retention_recurrent(**step)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=3), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, final, rtol=0, atol=1e-12)


def banked_recurrence(q, k, v, log_rates, bank_weights, bank_skip, bank):
    """The paper's eqs. 14-16 literally: K banks of S + 1 slots, token t routed to bank ``bank[t]`` alone."""
    batch, groups, per_group, length, features = q.shape
    banks, slots = bank_weights.shape
    G = torch.zeros(batch, groups, banks, slots, features, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(length):
        route = torch.nn.functional.one_hot(bank[:, :, t], banks).to(q.dtype)  # (B, G, K)
        G = torch.exp(log_rates[0])[:, None, None] * G
        G = G + torch.einsum("bgk,ks,bgf,bgv->bgksfv", route, bank_weights, k[:, :, t], v[:, :, t])
        read = torch.einsum("bgjf,bgksfv->bgjv", q[:, :, :, t], G)
        skip = torch.einsum("bgk,k->bg", route, bank_skip)
        outs.append(read + (skip[:, :, None] * torch.einsum("bgjf,bgf->bgj", q[:, :, :, t], k[:, :, t]))[..., None]
                    * v[:, :, None, t])
    return torch.stack(outs, dim=3)


def test_routed_banks_collapse_exactly():
    """Rates do not depend on alpha, so K banks sum into one set of slots with per-token weights c_s(alpha_k)."""
    delta, banks = 0.1, 10
    orders = delta + (1 - delta) * torch.arange(1, banks + 1, dtype=torch.float64) / banks  # includes 1
    bank_weights, bank_skip = soe_weights(orders, TERMS, HORIZON)
    x = inputs(length=40)
    bank = torch.randint(0, banks, x["k"].shape[:3], generator=torch.Generator().manual_seed(3))
    expected = banked_recurrence(x["q"], x["k"], x["v"], x["log_rates"], bank_weights, bank_skip, bank)
    weights, skip = bank_weights[bank], bank_skip[bank]
    for form in (retention_quadratic, retention_recurrent, retention_chunked):
        out, _ = form(x["q"], x["k"], x["v"], x["log_rates"], weights, skip)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12, msg=form.__name__)


def test_shapes_are_checked_by_name():
    x = inputs()
    with pytest.raises(ValueError, match="weights must be"):
        retention_chunked(**{**x, "weights": x["weights"][:, :, :5]})
    with pytest.raises(ValueError, match="log_rates must be"):
        retention_chunked(**{**x, "log_rates": x["log_rates"].expand(3, -1)})
    with pytest.raises(ValueError, match="state must be"):
        retention_recurrent(**{**x, "state": x["state"][:, :, 1:]})
    with pytest.raises(ValueError, match="k .* do not match q"):
        retention_quadratic(**{**x, "k": x["k"][:, :, 1:]})


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_leaves_the_fp32_math_alone(low):
    """A bf16 / fp16 training run wraps every forward in torch.autocast, which would run these einsums in the low
    precision (0.7% error in bf16; fp16's range overflows the sums): every form computes in the dtype it is given."""
    x = {key: value.float() for key, value in inputs().items()}
    for form in (retention_quadratic, retention_recurrent, retention_chunked):
        expected, expected_state = form(**x)
        with torch.autocast("cpu", dtype=low):
            out, state = form(**x)
        assert out.dtype == state.dtype == torch.float32, form.__name__
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=form.__name__)
        torch.testing.assert_close(state, expected_state, rtol=1e-6, atol=1e-6, msg=form.__name__)


@pytest.mark.parametrize("include_current", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("per_group_rates", [False, True])
def test_the_simple_gla_form_equals_the_definition(include_current, with_state, per_group_rates):
    """On CUDA the chunked form's work goes to flash-linear-attention's chunk_simple_gla, one head a (KV head, slot,
    query head), the decay a constant per head (``g_gamma``). With fla's own naive recurrence in the kernel's place
    (it computes in fp32; its kernels need CUDA) it gives the definition's output, final state and gradients."""
    from hf_mixers.apps.bench.op_count import _simple_gla_reference
    from hf_mixers.kernels.retention import retention_simple_gla

    x = inputs(per_group_rates=per_group_rates)
    if not with_state:
        x["state"] = None
    names = [name for name in ("q", "k", "v", "weights", "skip", "state")
             if x[name] is not None and (include_current or name != "skip")]  # a strict read has no skip term
    results = {}
    for form in ("quadratic", "simple_gla"):
        leaves = {name: x[name].clone().requires_grad_(True) for name in names}
        run = retention_quadratic if form == "quadratic" else \
            (lambda **a: retention_simple_gla(**a, kernel=_simple_gla_reference))
        out, state = run(**{**x, **leaves}, include_current=include_current)
        grads = torch.autograd.grad(out.sin().sum() + state.cos().sum(), list(leaves.values()))
        results[form] = [out, state, *grads]
    for name, got, want in zip(["out", "state", *names], results["simple_gla"], results["quadratic"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5, msg=name)  # fp32 sums of terms up to ~40


@pytest.mark.parametrize("window", [0, 8])
def test_a_vort_layer_on_its_library_kernels_equals_its_pytorch_path(window):
    """VORT's layer as converted (routed orders, the decayed normaliser, the local window or none), packed and left
    padded, with its CUDA library kernels in place (fla's chunk_simple_gla for the retention, flex_attention for the
    window: their CPU stand-ins) against the PyTorch path, output and gradients."""
    from hf_mixers.apps.bench.harness import build_mixer, rotary_embeddings
    from hf_mixers.apps.bench.op_count import LIBRARY_KERNELS
    from hf_mixers.kernels.dispatch import library_stand_ins

    torch.manual_seed(0)
    layer, config = build_mixer("vort", {"vort_window": window}, 32, 4, 2, "cpu", torch.float32)
    x = torch.randn(2, 30, 32)
    token_mask = torch.ones(2, 30, dtype=torch.bool)
    token_mask[1, :6] = False
    embeddings = rotary_embeddings(config, x, 30)
    calls = []

    def counted(name, function):
        return lambda *a, **k: calls.append(name) or function(*a, **k)

    results = {}
    for path, stand_ins in (("torch", {}), ("library", {key: counted(name, function) for key, (name, function)
                                                        in LIBRARY_KERNELS.items()})):
        leaf = x.clone().requires_grad_()
        with library_stand_ins(stand_ins):
            out = layer(leaf, embeddings, token_mask=token_mask)[token_mask]
        results[path] = [out, *torch.autograd.grad(out.pow(2).sum(), [leaf, *layer.parameters()])]
    assert sorted(calls) == ["chunk_simple_gla"] + ["flex_attention"] * bool(window)
    for got, want in zip(results["library"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
