"""The selective-SSM paper's analytical constructions (Huang et al., ICML 2025, App. C) as hand-set weights of our
``selective_ssm`` mixer: identity in/out projections, one head, fp64. Each returns (accuracy, scored positions) on
instances from the paper's task generators (hf_mixers.tasks.selective_ssm); the claim is 100% on every instance.
tests/unit/test_ssm_constructions.py runs the same functions, plus the variants that must fail as printed."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...model.config import config_class
from ...tasks.selective_ssm import IGNORE, induction_heads, keep_nth, mqar
from . import claim

F64 = torch.float64
INV_SOFTPLUS_1 = math.log(math.e - 1.0)  # softplus(ln(e - 1)) = 1: Δ = 1
ZERO_DECAY = float("-inf")  # A_log = -inf: A = -0, no decay at all


def hand_set_mixer(variant, width, state_size, **options):
    """A one-head ``selective_ssm`` mixer of width d = ``width`` with every weight zero, v_proj = o_proj = I. (The
    backbone config asks for an even head_dim, for RoPE; odd constructions carry one unused zero channel.)"""
    from ...mixers.selective_ssm import SelectiveSSMMixer

    options = {"gate": False, "use_d": False, "rmsnorm": False, "dt_rank": 0, "chunk_size": 16, **options}
    config = config_class("selective_ssm")(
        vocab_size=8, hidden_size=width, intermediate_size=4, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, head_dim=width, selective_ssm_variant=variant, selective_ssm_state_size=state_size,
        **{f"selective_ssm_{key}": value for key, value in options.items()})
    mixer = SelectiveSSMMixer(config, 0).to(F64)
    with torch.no_grad():
        for parameter in mixer.parameters():
            parameter.zero_()
        mixer.v_proj.weight.copy_(torch.eye(width))
        mixer.o_proj.weight.copy_(torch.eye(width))
    return mixer


def run(mixer, embeddings):
    with torch.no_grad():
        return mixer.mix(embeddings)[0]


def accuracy(logits, targets):
    scored = targets != IGNORE
    return (logits.argmax(-1)[scored] == targets[scored]).double().mean().item(), int(scored.sum())


def selector(rows, columns, offset=0):
    """[I | 0]-style (rows x columns) matrix picking columns offset .. offset + rows - 1."""
    matrix = torch.zeros(rows, columns, dtype=F64)
    matrix[:, offset:offset + rows] = torch.eye(rows, dtype=F64)
    return matrix


def value_targets(targets, pairs):
    """MQAR targets as value indices (the readouts score the values only)."""
    return torch.where(targets == IGNORE, IGNORE, targets - pairs)


def theorem_2_s6_mqar(pairs: int, count: int = 100, seed: int = 0):
    """S6 with N = κ state slots: shared conv (c0 = 1 on the previous token, c1 = 2 on the current, b = 1), Δ = 1,
    no decay, B = C = [I | 0] û; keys embedded as 2 e_i, values as e_{κ+j}."""
    values = 4 * pairs
    width = pairs + values
    mixer = hand_set_mixer("s6", width, pairs, conv_mode="shared", conv_width=2, conv_activation="relu")
    with torch.no_grad():
        mixer.conv_weight[:, 0], mixer.conv_weight[:, 1], mixer.conv_bias[:] = 1.0, 2.0, -1.0
        mixer.dt_proj.bias.fill_(INV_SOFTPLUS_1)
        mixer.A_log.fill_(ZERO_DECAY)
        mixer.k_proj.weight.copy_(selector(pairs, width))
        mixer.q_proj.weight.copy_(selector(pairs, width))
    embedding = torch.zeros(width, width, dtype=F64)
    embedding[:pairs, :pairs] = 2.0 * torch.eye(pairs)
    embedding[pairs:, pairs:] = torch.eye(values)
    tokens, targets = mqar(count, pairs, values, seed=seed)
    logits = run(mixer, embedding[tokens]) @ embedding[pairs:].T  # readout rows: the value embeddings
    return accuracy(logits, value_targets(targets, pairs))


def theorem_3_mamba2_mqar(pairs: int, count: int = 100, seed: int = 0):
    """Mamba-2 with independent convs over [u, B, C]: u and C identity kernels, B the shift by one token; Δ = 1."""
    values = 4 * pairs
    width = pairs + values
    mixer = hand_set_mixer("mamba2", width, pairs, conv_mode="independent", conv_width=2, conv_activation="relu")
    with torch.no_grad():
        mixer.conv_weight[:width, 1] = 1.0
        mixer.conv_weight[width:width + pairs, 0] = 1.0
        mixer.conv_weight[width + pairs:, 1] = 1.0
        mixer.dt_proj.bias.fill_(INV_SOFTPLUS_1)  # Δ ≡ 1 (the paper leaves it unstated; it must be constant)
        mixer.A_log.fill_(ZERO_DECAY)
        mixer.k_proj.weight.copy_(selector(pairs, width))
        mixer.q_proj.weight.copy_(selector(pairs, width))
    embedding = torch.eye(width, dtype=F64)
    tokens, targets = mqar(count, pairs, values, seed=seed)
    logits = run(mixer, embedding[tokens]) @ embedding[pairs:].T
    return accuracy(logits, value_targets(targets, pairs))


def theorem_4_s4d_mixer(width: int):
    """Mamba-S4D with one state: conv c0 = 10 (previous), c1 = 1, b = 100; Λ̄ = B = C = 1; the gate silu(x) selects."""
    mixer = hand_set_mixer("s4d", width, 1, conv_mode="shared", conv_width=2, conv_activation="relu", gate=True)
    with torch.no_grad():
        mixer.conv_weight[:, 0], mixer.conv_weight[:, 1], mixer.conv_bias[:] = 10.0, 1.0, -100.0
        mixer.A_log.fill_(ZERO_DECAY)
        mixer.B.fill_(1.0)
        mixer.C.fill_(1.0)
        mixer.z_proj.weight.copy_(torch.eye(width))
    return mixer


def theorem_4_s4d_mqar(pairs: int, values: int, count: int = 100, seed: int = 0):
    """``theorem_4_s4d_mixer`` of width κ |V|; key i -> all-ones on chunk i (scaled 10), value j -> e_j in every
    chunk."""
    mixer = theorem_4_s4d_mixer(pairs * values)
    chunks = torch.eye(pairs, dtype=F64).repeat_interleave(values, dim=1)
    embedding = torch.cat([10.0 * chunks, torch.eye(values, dtype=F64).repeat(1, pairs)])
    readout = torch.eye(values, dtype=F64).repeat(1, pairs)
    tokens, targets = mqar(count, pairs, values, seed=seed)
    logits = run(mixer, embedding[tokens]) @ readout.T
    return accuracy(logits, value_targets(targets, pairs))


def lemma_3_mixer(vocab, weight=40.0, bias=20.0, a_shape="channel_state"):
    """Mamba-Δᵀ for induction heads: d = 2|V|, N = |V|, û_t = [e_{x_{t-1}}; e_{x_t}], B = top half, C = bottom,
    Δ_t = softplus(w [I | 0] û_t - b) erases the column of the previous token, Λ = -1."""
    width = 2 * vocab
    mixer = hand_set_mixer("delta_t", width, vocab, conv_mode="shared", conv_width=2, conv_activation="relu",
                           a_shape=a_shape)
    with torch.no_grad():
        mixer.conv_weight[:vocab, 0] = 1.0  # previous token -> top half
        mixer.conv_weight[vocab:, 1] = 1.0  # current token -> bottom half
        mixer.A_log.zero_()  # A = -1
        mixer.k_proj.weight.copy_(selector(vocab, width))
        mixer.q_proj.weight.copy_(selector(vocab, width, offset=vocab))
        mixer.dt_proj.weight.copy_(weight * selector(vocab, width))
        mixer.dt_proj.bias.fill_(-bias)
    return mixer


def induction_logits(mixer, vocab, tokens):
    embedding = torch.cat([torch.eye(vocab, dtype=F64), torch.eye(vocab, dtype=F64)], dim=1)  # v -> [e_v; e_v]
    read = run(mixer, embedding[tokens])[..., vocab:]  # W_o = [0 | I]
    return torch.cat([read, torch.full_like(read[..., :1], 0.5)], dim=-1)  # the blank class: a constant 0.5


def lemma_3_delta_t_induction(vocab: int, a_shape: str = "channel_state", count: int = 100, seed: int = 0):
    tokens, targets = induction_heads(count, vocab, seed=seed)
    return accuracy(induction_logits(lemma_3_mixer(vocab, a_shape=a_shape), vocab, tokens), targets)


def corollary_2_s6_keep_nth(scaling: str = "euler", vocab: int = 128, length: int = 50, n: int = 5,
                            count: int = 500, seed: int = 0):
    """S6 with a raw position channel: B = C = the position, λ = 1, Δ_t = softplus(-w (t - n - 1/2)) keeps token n."""
    w = 40.0
    width = vocab + 2  # one-hot, the position channel, an unused zero channel (even width)
    mixer = hand_set_mixer("s6", width, 1, conv_mode="none", input_scaling=scaling)
    with torch.no_grad():
        mixer.k_proj.weight[0, vocab] = 1.0
        mixer.q_proj.weight[0, vocab] = 1.0
        mixer.A_log.zero_()
        mixer.dt_proj.weight[:, vocab] = -w
        mixer.dt_proj.bias.fill_(w * (n + 0.5))
    tokens, targets = keep_nth(count, vocab, length, n, seed=seed)
    embeddings = F.one_hot(tokens, width).to(F64)
    embeddings[..., vocab] = torch.arange(1, length + 1, dtype=F64)  # the raw 1-indexed position
    return accuracy(run(mixer, embeddings)[..., :vocab], targets)


@claim("ssm-constructions", "Huang et al., selective SSMs (Theorems 2-4, Lemma 3, Corollary 2)",
       "hand-set S6, Mamba-2, Mamba-S4D and Mamba-Δᵀ layers solve MQAR, induction heads and KEEP n-th exactly")
def ssm_constructions(out_dir: str, scale: str) -> dict:
    sizes = (4, 8, 16, 32) if scale != "paper" else (4, 8, 16, 32, 64)
    rows = []
    for pairs in sizes:
        rows.append({"construction": "Theorem 2: S6, MQAR, N = κ", "size": f"κ = {pairs}",
                     "accuracy": theorem_2_s6_mqar(pairs, seed=pairs)[0]})
        rows.append({"construction": "Theorem 3: Mamba-2, MQAR", "size": f"κ = {pairs}",
                     "accuracy": theorem_3_mamba2_mqar(pairs, seed=100 + pairs)[0]})
    for pairs, values in ((4, 8), (8, 16)):
        rows.append({"construction": "Theorem 4: Mamba-S4D, MQAR, one state", "size": f"κ = {pairs}, |V| = {values}",
                     "accuracy": theorem_4_s4d_mqar(pairs, values, seed=200 + pairs)[0]})
    for vocab in (5, 10, 20, 40):
        rows.append({"construction": "Lemma 3: Mamba-Δᵀ, induction heads", "size": f"|V| = {vocab}",
                     "accuracy": lemma_3_delta_t_induction(vocab, seed=vocab)[0]})
    for scaling in ("euler", "zoh"):
        rows.append({"construction": f"Corollary 2: S6, KEEP 5-th ({scaling})", "size": "|V| = 128, T = 50",
                     "accuracy": corollary_2_s6_keep_nth(scaling)[0]})
    worst = min(row["accuracy"] for row in rows)
    return {"paper_value": "100% on every instance (exact constructions)",
            "ours": f"{sum(row['accuracy'] == 1.0 for row in rows)} of {len(rows)} at 100% (lowest {worst:.3f}), "
                    "100-500 random instances each",
            "holds": worst == 1.0, "table": rows,
            "notes": ["three printed constructions need corrections to work, tested as such in "
                      "tests/unit/test_ssm_constructions.py: Theorem 2 step 2's output bias lacks a factor (2-4% as "
                      "printed), Theorem 4 step 2's rotation leaves an offset (chance as printed, balanced JL "
                      "columns fix it), Lemma 3 needs its Δ bias (a blank class wins without it)"]}
