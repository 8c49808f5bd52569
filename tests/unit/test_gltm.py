"""GLTM (hf_mixers/mixers/gltm.py): the layer against a literal loop over Eq. 1, the chunked solve against the dense
reference (values and gradients), row-stochastic mixing, the decode caches' sizes, and the gate calibration. The
contract suite (prefill + decode, left padding, save/load, ...) runs on every pattern through tiny_variants."""

import math

import pytest
import torch

from hf_mixers.kernels.token_patterns import pattern_support
from hf_mixers.mixers.gltm import GLTMMixer
from hf_mixers.testing import graphs_built, reset_compiled_steps, tiny_model

F64 = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-10)
PATTERNS = ["attention", "local", "ssm", "banded", "dense", "pow2", "pow2_ce", "quad", "quad_ce", "custom_ce"]


def gltm_model(pattern, seed=0, **options):
    """A tiny fp64 GLTM model with every parameter moved off its init (so gates and both attentions vary)."""
    extra = {"gltm_offsets": "pow:3"} if pattern.startswith("custom") else {}
    model = tiny_model("gltm", seed=seed, gltm_pattern=pattern, **extra, **options)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def layer_inputs(model, batch=2, length=21, seed=2):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, model.config.hidden_size, generator=generator, dtype=F64)
    positions = torch.arange(length)[None].expand(batch, -1)
    return hidden, model.model.rotary_emb(hidden, position_ids=positions)


def eq1_loop(mixer, hidden, position_embeddings):
    """Eq. 1 token by token, per head, with the supports of kernels/token_patterns.py written out by hand."""
    batch, length, _ = hidden.shape
    pattern, window, scale = mixer.pattern, mixer.window, mixer.head_dim ** -0.5
    q, k, v = mixer.project(hidden, position_embeddings)
    groups = mixer.num_key_value_groups
    recurrent = pattern not in ("attention", "local")
    if recurrent:
        qb, kb = mixer.project_feedback(hidden, position_embeddings)
        gate = mixer.gate(hidden)  # (B, T, H)
    past = pattern_support(pattern, length, window, mixer.config.gltm_offsets) if recurrent else None
    y = torch.zeros(batch, mixer.num_heads, length, mixer.head_dim, dtype=F64)
    for b in range(batch):
        for h in range(mixer.num_heads):
            kv = h // groups
            for i in range(1, length + 1):
                if pattern == "attention":
                    direct_support = list(range(1, i + 1))
                elif pattern == "local":
                    direct_support = list(range(max(1, i - window + 1), i + 1))
                elif pattern == "ssm":
                    direct_support = [i]
                else:
                    direct_support = [i] + past[i - 1]
                scores = torch.stack([q[b, h, i - 1] @ k[b, kv, j - 1] * scale for j in direct_support])
                direct = (torch.softmax(scores, 0)[:, None] * v[b, kv, [j - 1 for j in direct_support]]).sum(0)
                if not recurrent or i == 1:
                    y[b, h, i - 1] = direct
                    continue
                scores = torch.stack([qb[b, h, i - 1] @ kb[b, kv, j - 1] * scale for j in past[i - 1]])
                recurrence = (torch.softmax(scores, 0)[:, None] * y[b, h, [j - 1 for j in past[i - 1]]]).sum(0)
                g = gate[b, i - 1, h]
                y[b, h, i - 1] = (1 - g) * direct + g * recurrence
    return mixer.o_proj(y.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_layer_is_eq1_token_by_token(pattern):
    model = gltm_model(pattern)
    mixer = model.model.layers[0].mixer
    hidden, position_embeddings = layer_inputs(model, batch=1, length=19)
    with torch.no_grad():
        torch.testing.assert_close(mixer(hidden, position_embeddings), eq1_loop(mixer, hidden, position_embeddings),
                                   **EXACT)


@pytest.mark.parametrize("pattern", ["ssm", "banded", "dense", "pow2", "pow2_ce", "quad", "quad_ce"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_the_chunked_solve_equals_the_dense_reference_with_gradients(pattern, chunk_size):
    model = gltm_model(pattern, gltm_chunk_size=chunk_size)
    reference = gltm_model(pattern, gltm_solver="dense")
    hidden, position_embeddings = layer_inputs(model)
    results = []
    for m in (model, reference):
        mixer = m.model.layers[0].mixer
        x = hidden.clone().requires_grad_()
        out = mixer(x, position_embeddings)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum() + out.pow(2).sum()
        parameters = [p for _, p in sorted(mixer.named_parameters())]
        results.append((out, torch.autograd.grad(loss, [x, *parameters])))
    (out, grads), (expected, expected_grads) = results
    torch.testing.assert_close(out, expected, **EXACT)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_output_is_a_convex_combination_of_values(pattern):
    """(A + B) 1 = 1 with nonnegative entries: with every value 1, every output (before o_proj) is 1, padding too."""
    model = gltm_model(pattern)
    seen = []
    for block in model.model.layers:
        block.mixer.v_proj.register_forward_hook(lambda module, args, output: torch.ones_like(output))
        block.mixer.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    ids = torch.randint(3, 60, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for y in seen:
        torch.testing.assert_close(y[mask.bool()], torch.ones_like(y[mask.bool()]), **EXACT)


@pytest.mark.parametrize("pattern,kept", [
    ("pow2_ce", lambda t: math.ceil(math.log2(t + 1))),  # what token t + 1 reads: ceil(log2(t + 1)) positions
    ("quad_ce", lambda t: len(pattern_support("quad_ce", t + 1)[t])),
    ("banded", lambda t: min(t, 3)), ("ssm", lambda t: 1), ("local", lambda t: min(t, 2)),
    ("pow2", lambda t: t), ("dense", lambda t: t)])
def test_decode_caches_keep_what_the_next_token_reads(pattern, kept):
    model = gltm_model(pattern)  # bandwidth 3 (the tiny options)
    ids = torch.randint(3, 60, (1, 40))
    cache = None
    with torch.no_grad():
        for t in range(1, 41):
            cache = model(ids[:, t - 1:t], past_key_values=cache, use_cache=True).past_key_values
            layer = cache.layers[0]
            assert layer.get_seq_length() == t
            assert layer.positions.shape[1] == kept(t), (pattern, t)
            if pattern in ("pow2", "dense"):  # translation-invariant and dense patterns keep everything
                expected = set(range(1, t + 1))
            elif pattern == "local":  # the next token's window, itself excluded
                expected = {t - 1, t} - {0}
            else:  # exactly the next token's B-support
                expected = set(pattern_support(pattern, t + 1, 3)[t])
            assert set(layer.positions[0].tolist()) == expected, (pattern, t)


def test_pow2_ce_cache_grows_like_log_t_not_t():
    model = gltm_model("pow2_ce")
    with torch.no_grad():
        cache = model(torch.randint(3, 60, (1, 1000)), use_cache=True).past_key_values
    assert cache.layers[0].positions.shape[1] == math.ceil(math.log2(1001)) == 10
    assert cache.layers[0].keys.shape[2] == 10


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_the_compiled_step_keeps_fixed_slots_and_grows_them_once_past_the_model_length():
    """``compile_decode`` on pow2_ce: the cache sits at ``decode_slots`` slots (3 up to max_position_embeddings = 8:
    offsets 1, 2, 4), empty ones at position 0, holding exactly what the next token reads; from the token whose next
    one passes 8 it has 4 slots, enough up to 16 (one more graph, then none); every step equals the eager decode (to
    fp32's precision: the Llama RMSNorm computes in fp32 in any model dtype, and the graph sums in another order)."""
    eager = gltm_model("pow2_ce", max_position_embeddings=8)
    compiled = gltm_model("pow2_ce", max_position_embeddings=8, compile_decode=True)
    ids = torch.randint(3, 60, (1, 15), generator=torch.Generator().manual_seed(0))
    reset_compiled_steps()
    caches = [None, None]
    with torch.no_grad():
        for t in range(3, 16):
            chunk = ids[:, :3] if t == 3 else ids[:, t - 1:t]  # a 3-token prefill, then one token at a time
            logits = []
            for i, model in enumerate((eager, compiled)):
                out = model(chunk, past_key_values=caches[i], use_cache=True)
                caches[i] = out.past_key_values
                logits.append(out.logits[:, -1])
            torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
            layer = caches[1].layers[0]
            if t > 3:  # after a compiled step: the slots of the run's length so far
                assert layer.positions.shape[1] == (3 if t < 8 else 4), t
            assert set(layer.positions[0].tolist()) - {0} == set(pattern_support("pow2_ce", t + 1)[t]), t
    assert graphs_built() == 2  # up to 8 and up to 16 positions


def test_dense_with_the_gate_off_is_the_teacher_attention_and_calibration_picks_the_closest_gate():
    from hf_mixers.core.attention import FullAttention

    model = gltm_model("dense", gltm_gate="fixed", gltm_gate_value=0.0)
    mixer = model.model.layers[0].mixer
    teacher = FullAttention(model.config, 0).to(F64)
    teacher.load_state_dict({k: v for k, v in mixer.state_dict().items() if k.split(".")[0] in
                             ("q_proj", "k_proj", "v_proj", "o_proj")})
    hidden, position_embeddings = layer_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(mixer(hidden, position_embeddings), teacher(hidden, position_embeddings), **EXACT)
    for pattern in ("dense", "pow2_ce"):
        config = gltm_model(pattern).config
        converted = GLTMMixer.from_attention(teacher, config, 0, calibration_hidden_states=hidden,
                                             calibration_position_embeddings=position_embeddings)
        chosen = converted.gate(hidden)
        errors = converted.calibrate_gate(teacher, hidden, position_embeddings)
        best = min(errors, key=errors.get)
        assert len(errors) == 6 and torch.allclose(chosen, torch.full_like(chosen, best), rtol=1e-9, atol=0)
        if pattern == "dense":  # the gate stays off: the converted layer is its teacher to ~1e-6
            assert best == 1e-6 and errors[best] < 1e-5
        else:  # a sparse A-branch alone misses the long-range mass: some feedback helps
            assert errors[best] < errors[1e-6]


def before_o_proj(mixer, hidden, position_embeddings):
    seen = []
    handle = mixer.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        mixer(hidden, position_embeddings)
    handle.remove()
    return seen[0].view(*hidden.shape[:2], mixer.num_heads, mixer.head_dim).transpose(1, 2)  # (B, H, T, d)


def test_shared_rows_are_kept_apart_for_a_diagonal_and_a_full_a_branch():
    """The support rows an unpadded call builds once per shape (``shared_rows``) are kept by a name that says whether
    A is diagonal: a weight-shared layer (no A rows) built first must not hand its None to an unshared layer of the
    same pattern and length, whose A-branch reads the window's rows."""
    shared_first = gltm_model("pow2_ce", gltm_weight_sharing=True).model.layers[0].mixer
    unshared = gltm_model("pow2_ce").model.layers[0].mixer
    assert shared_first.shared_rows(23, "cpu")[0] is None
    a_rows, b_rows = unshared.shared_rows(23, "cpu")
    assert a_rows is not None and a_rows.shape[:2] == (1, 23)
    assert torch.equal(b_rows, shared_first.shared_rows(23, "cpu")[1])


@pytest.mark.parametrize("pattern", ["pow2_ce", "banded", "dense"])
def test_weight_sharing_is_the_tied_matrix_form(pattern):
    """Eq. 25 against the literal A = B D + D': build B (T x T, per head) from the layer's own B-branch, form A, solve
    Y = (I - B)^-1 A X densely, and compare with the layer (which runs Eq. 26 through the shared solve)."""
    model = gltm_model(pattern, gltm_weight_sharing=True)
    mixer = model.model.layers[0].mixer
    hidden, position_embeddings = layer_inputs(model, batch=1, length=17)
    length, scale = hidden.shape[1], mixer.head_dim ** -0.5
    with torch.no_grad():
        _, _, v = mixer.project(hidden, position_embeddings)
        qb, kb = mixer.project_feedback(hidden, position_embeddings)
        gate = mixer.gate(hidden)[0]  # (T, H)
        d, d_prime = mixer.share_proj(hidden)[0].chunk(2, dim=-1)  # (T, H) each
    supports = pattern_support(pattern, length, mixer.window)
    y = before_o_proj(mixer, hidden, position_embeddings)
    for h in range(mixer.num_heads):
        kv = h // mixer.num_key_value_groups
        B = torch.zeros(length, length, dtype=F64)
        for i, row in enumerate(supports, start=1):
            if row:
                weights = torch.softmax(torch.stack([qb[0, h, i - 1] @ kb[0, kv, j - 1] * scale for j in row]), 0)
                B[i - 1, [j - 1 for j in row]] = gate[i - 1, h] * weights
        A = B @ torch.diag(d[:, h]) + torch.diag(d_prime[:, h])
        expected = torch.linalg.solve(torch.eye(length, dtype=F64) - B, A @ v[0, kv])
        torch.testing.assert_close(y[0, h], expected, **EXACT)


def test_the_mamba_rule_for_ssm_is_the_scalar_recurrence():
    model = gltm_model("ssm", gltm_ssm_rule="mamba")
    mixer = model.model.layers[0].mixer
    hidden, position_embeddings = layer_inputs(model, batch=2, length=15)
    y = before_o_proj(mixer, hidden, position_embeddings)
    with torch.no_grad():
        _, _, v = mixer.project(hidden, position_embeddings)
        delta = torch.nn.functional.softplus(mixer.dt_proj(hidden))  # (B, T, H)
        b = mixer.b_proj(hidden)
        a = -torch.exp(mixer.A_log)
    state = torch.zeros(2, mixer.num_heads, mixer.head_dim, dtype=F64)
    for t in range(15):
        x = v[:, :, t].repeat_interleave(mixer.num_key_value_groups, dim=1)  # (B, H, d)
        state = torch.exp(delta[:, t] * a)[..., None] * state + (delta[:, t] * b[:, t])[..., None] * x
        torch.testing.assert_close(y[:, :, t], state, **EXACT)


def test_invalid_combinations_are_refused_by_name():
    from hf_mixers.testing import tiny_config

    for options, message in (({"gltm_pattern": "pow2", "gltm_ssm_rule": "mamba"}, "gltm_ssm_rule"),
                             ({"gltm_pattern": "local", "gltm_weight_sharing": True}, "gltm_weight_sharing"),
                             ({"gltm_pattern": "custom"}, "gltm_offsets"),
                             ({"gltm_pattern": "custom", "gltm_offsets": "poly:2,5"}, "f\\(0\\) must be 1"),
                             ({"gltm_pattern": "pow2", "gltm_offsets": "pow:3"}, "only read by the custom"),
                             ({"gltm_gate": "fixed", "gltm_gate_value": 1.5}, "gltm_gate_value")):
        with pytest.raises(ValueError, match=message):
            tiny_config("gltm", **options)
