"""The VORT mixer (hf_mixers/mixers/vort.py): the layer equals its quadratic definition in fp64 for every option
that changes the math; alpha = 1 with exact exp scores and the shared normaliser is the teacher's attention (the
conversion identity); the SOE's error bound holds at layer level against the exact lgamma power law; the router reads
the window entropy; the decode state does not grow. The contract suite (decode, padding, generate, remote code, ...)
runs on VORT and its variants in tests/contract/test_mixer_contract.py."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_mixers import get_mixer
from hf_mixers.conversion.families import backbone_fields
from hf_mixers.core.cache import cache_nbytes
from hf_mixers.model.config import config_class
from hf_mixers.testing import TINY, tiny_config, tiny_model

VARIANTS = {
    "sum": {},
    "gated_sum": {"vort_combine": "gated_sum"},
    "shared_normalizer": {"vort_combine": "shared_normalizer"},
    "shared_global_rope": {"vort_combine": "shared_normalizer", "vort_global_rope": True},
    "no_window": {"vort_window": 0},
    "strict_undecayed": {"vort_window": 0, "vort_include_current": False, "vort_normalizer": "undecayed"},
    "undecayed_shared": {"vort_normalizer": "undecayed", "vort_combine": "shared_normalizer"},
    "power": {"vort_kernel": "power"},
    "power_no_window": {"vort_kernel": "power", "vort_window": 0},
    "nearest_bank": {"vort_alpha_quantization": "nearest_bank"},
    "fixed": {"vort_alpha_mode": "fixed", "vort_alpha_fixed": 0.6},
    "exp": {"vort_kernel": "exp", "vort_combine": "shared_normalizer"},
    "mixture_no_window": {"vort_kernel": "mixture", "vort_window": 0},
    "hedgehog": {"vort_feature_map": "hedgehog", "vort_combine": "shared_normalizer"},
    "elu1": {"vort_feature_map": "elu1", "vort_feature_dim": 8, "vort_window": 0},
}


def routed_mixer(options: dict, seed: int = 0):
    """Layer 0 of a tiny fp64 VORT model with a live router (random W_a, entropy weight 1.5), a gated_sum gate at
    0, and a random hidden state and RoPE for 20 tokens."""
    model = tiny_model("vort", **options)
    mixer = model.model.layers[0].mixer
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if hasattr(mixer, "alpha_proj"):
            mixer.alpha_proj.weight.copy_(torch.randn(mixer.alpha_proj.weight.shape, generator=generator,
                                                      dtype=torch.float64))
            if mixer.alpha_entropy is not None:
                mixer.alpha_entropy.fill_(1.5)
        if mixer.window_gate is not None:
            mixer.window_gate.zero_()
    hidden = torch.randn(2, 20, TINY["hidden_size"], generator=generator, dtype=torch.float64)
    positions = model.model.rotary_emb(hidden, torch.arange(20)[None])
    return mixer, hidden, positions


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_equals_its_quadratic_definition(variant):
    mixer, hidden, positions = routed_mixer(VARIANTS[variant])
    with torch.no_grad():
        out, _, _ = mixer.mix(hidden, positions)
    expected = mixer.reference(hidden, positions)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


def teacher_attention(family: str, seed: int = 0):
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    teacher = model_cls(config_cls(**{**TINY, "num_hidden_layers": 1, "sliding_window": None,
                                      **({"head_dim": 16} if family == "qwen3" else {})})).double().eval()
    return teacher


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_alpha_one_with_exact_scores_and_the_shared_normaliser_is_the_teacher(family):
    """Spec identity: alpha = 1 (no decay), one normaliser over window and memory, exp(q.k / sqrt(d)) in place of
    the features -> the teacher's attention, with the memory holding 9 of 12 tokens."""
    teacher = teacher_attention(family)
    spec = get_mixer("vort")
    options = {**spec.conversion_options, "vort_window": 3, "vort_alpha_mode": "fixed", "vort_alpha_fixed": 1.0,
               "vort_eps0": 0.0, "vort_soe_horizon": 64, "vort_chunk_size": 4}
    config = config_class("vort")(**{**backbone_fields(teacher.config), "sliding_window": None},
                                  layer_types=["vort"], **options)
    attention = teacher.model.layers[0].self_attn
    mixer = spec.mixer_class.from_attention(attention, config, 0).eval()
    hidden = torch.randn(2, 12, TINY["hidden_size"], dtype=torch.float64)
    positions = teacher.model.rotary_emb(hidden, torch.arange(12)[None])
    with torch.no_grad():
        expected = attention(hidden, position_embeddings=positions, attention_mask=None)[0]
    exact = mixer.reference(hidden, positions, scores="exact")
    torch.testing.assert_close(exact, expected, rtol=0, atol=1e-12)
    approximate = mixer.reference(hidden, positions)  # FAVOR+ features: an estimate, not the teacher
    assert (approximate - expected).abs().max() > 1e-6


def test_soe_error_bound_holds_at_layer_level():
    """Against the exact lgamma power law over 200 tokens (the paper's "exact fractional convolution"): the output
    error shrinks with S as the kernel's does (max kernel error ~1e-3 at S = 15, ~1e-5 at S = 30)."""
    errors = {}
    for terms in (15, 30):
        mixer, hidden, positions = routed_mixer({"vort_window": 0, "vort_soe_terms": terms,
                                                 "vort_soe_horizon": 1000})
        hidden = hidden.repeat(1, 10, 1)  # 200 tokens
        positions = tiny_model("vort").model.rotary_emb(hidden, torch.arange(200)[None])
        soe = mixer.reference(hidden, positions)
        exact = mixer.reference(hidden, positions, lags="exact")
        errors[terms] = ((soe - exact).norm() / exact.norm()).item()
    assert errors[15] < 2e-3 and errors[30] < 2e-5 and errors[30] < errors[15] / 20, errors


def test_orders_lie_in_delta_one_and_follow_the_window_entropy():
    mixer, hidden, positions = routed_mixer({})
    entropy = torch.rand(2, 2, 2, 20, dtype=torch.float64)
    with torch.no_grad():
        alpha = mixer.orders(hidden, entropy)
        shifted = mixer.orders(hidden, entropy + 0.5)
    delta = mixer.config.vort_delta
    assert alpha.shape == (2, 2, 20) and bool(((alpha >= delta) & (alpha <= 1)).all())
    assert bool((shifted > alpha).all())  # entropy weight 1.5 > 0: more entropy, a higher order
    plain = tiny_model("vort", vort_window=0).model.layers[0].mixer
    assert plain.alpha_entropy is None and plain.config.vort_entropy_source == "none"


def test_conversion_starts_near_alpha_one_with_the_teachers_projections():
    teacher = teacher_attention("qwen2")
    spec = get_mixer("vort")
    config = config_class("vort")(**{**backbone_fields(teacher.config), "sliding_window": None},
                                  layer_types=["vort"], **spec.conversion_options)
    attention = teacher.model.layers[0].self_attn
    mixer = spec.mixer_class.from_attention(attention, config, 0)
    hidden = torch.randn(1, 5, TINY["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mixer.orders(hidden), torch.full((1, 2, 5), 0.95, dtype=torch.float64))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        torch.testing.assert_close(getattr(mixer, name).weight, getattr(attention, name).weight)
    assert config.vort_combine == "shared_normalizer" and config.vort_global_rope
    assert config.vort_feature_map == "hedgehog" and mixer.hedgehog_q.shape == (2, 8, 8)


def test_decode_state_does_not_grow_with_the_context():
    from transformers import DynamicCache

    model = tiny_model("vort", vort_combine="shared_normalizer")
    sizes = []
    for length in (20, 60):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.randint(3, 60, (1, length)), past_key_values=cache, use_cache=True)
        sizes.append(cache_nbytes(cache))
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("options, field", [
    ({"vort_kernel": "power", "vort_include_current": True}, "vort_include_current"),
    ({"vort_window": 0, "vort_entropy_source": "local_attention"}, "vort_entropy_source"),
    ({"vort_feature_map": "elu1", "vort_feature_dim": 5}, "vort_feature_dim"),
    ({"vort_feature_map": "hedgehog", "vort_feature_dim": 7}, "vort_feature_dim"),
    ({"vort_alpha_init": 1.0}, "vort_alpha_init"),
    ({"vort_delta": 0.0}, "vort_delta"),
    ({"vort_combine": "concat"}, "vort_combine"),
])
def test_bad_options_are_named(options, field):
    with pytest.raises(ValueError, match=field):
        tiny_config("vort", **options)


def test_plasticity_loss_is_eq_24_and_trains_the_router():
    """The retrieval loss against a direct evaluation of eq. 24, its default target (the teacher's most-attended
    token outside the window), and a few gradient steps on the router alone lowering it."""
    from hf_mixers.kernels.soe import soe_kernel

    mixer, hidden, positions = routed_mixer({"vort_plasticity_weight": 0.5})
    hidden, positions = hidden[:1, :9], tuple(p[:1, :9] for p in positions)
    source = torch.tensor([[-1, -1, 0, 1, 0, 2, 4, 1, 6]])
    loss = mixer.plasticity_loss(hidden, positions, source)
    with torch.no_grad():
        q, k, _, _, _ = mixer.projections(hidden, positions)
        entropy = mixer.quadratic_window(q, k, k)[2]
        alpha = mixer.orders(hidden, entropy)[0]  # (G, T)
        c = mixer.config
        rates, weights, _ = soe_kernel(alpha, c.vort_soe_terms, c.vort_soe_horizon, c.vort_soe_eps)
        terms = []
        for g in range(2):
            for j in range(2):
                for t in range(2, 9):
                    r = torch.stack([torch.exp(q[0, g, j, t] @ k[0, g, i] / 8 ** 0.5)
                                     * (weights[g, i] * rates ** (t - i)).sum() for i in range(t)])
                    terms.append(-torch.log(r[source[0, t]] / r.sum()))
    torch.testing.assert_close(loss.detach(), torch.stack(terms).mean(), rtol=1e-12, atol=0)

    default = mixer.plasticity_loss(hidden, positions)  # targets: argmax of the scores over i <= t - w
    assert default.item() > 0 and mixer.auxiliary_loss(hidden, positions).item() == pytest.approx(
        0.5 * default.item())
    router = [mixer.alpha_proj.weight, mixer.alpha_proj.bias, mixer.alpha_entropy]
    optimizer = torch.optim.SGD(router, lr=0.5)
    first = None
    for _ in range(10):
        optimizer.zero_grad()
        value = mixer.plasticity_loss(hidden, positions)
        value.backward()
        first = value.item() if first is None else first
        optimizer.step()
    assert mixer.plasticity_loss(hidden, positions).item() < first
    assert tiny_model("vort").model.layers[0].mixer.auxiliary_loss(hidden, positions) is None  # weight 0: off
