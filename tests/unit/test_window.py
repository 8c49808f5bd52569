"""The local-window branch (hf_mixers/core/window.py) against exact references, in fp64.

The identity behind it: a window over the last w tokens plus a memory that holds every older token exactly and
reports its softmax mass, merged through the shared normaliser, is full causal softmax attention. So with an exact
(growing) memory the branch must give full attention, whatever w, for long and short inputs, in one call or token by
token, with left padding.
"""

import pytest
import torch

from hf_mixers.core.window import windowed
from hf_mixers.kernels.local_attention import window_attention
from hf_mixers.kernels.rsa_memory import initial_state, rsa_chunked, rsa_recurrent
from test_rsa_memory import make_inputs, make_params

F64 = torch.float64
SCALE = 0.35


def qkv(batch=3, groups=2, per_group=2, length=11, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, groups, per_group, length, dim, generator=generator, dtype=F64)
    keys = torch.randn(batch, groups, length, dim, generator=generator, dtype=F64)
    values = torch.randn(batch, groups, length, dim + 1, generator=generator, dtype=F64)
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    return query, keys, values, valid


def masked_attention(query, keys, values, allowed):
    """Softmax attention with an explicit (B, T, S) mask -> output and log normaliser; the plain reference."""
    scores = torch.einsum("bgjtd,bgsd->bgjts", query, keys) * SCALE
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    log_normaliser = torch.logsumexp(scores, -1)
    return torch.einsum("bgjts,bgsd->bgjtd", torch.softmax(scores, -1), values), log_normaliser


@pytest.mark.parametrize("window, length, past", [(4, 3, 0), (4, 4, 2), (4, 11, 0), (3, 12, 3), (5, 11, 5),
                                                  (16, 11, 0), (1, 7, 1)])
def test_window_attention_equals_a_banded_mask(window, length, past):
    query, keys, values, valid = qkv(length=length)
    # w earlier positions (only the last ``past`` of them real), then the new tokens
    _, earlier_k, earlier_v, _ = qkv(length=window, seed=1)
    earlier_valid = torch.zeros(3, window, dtype=torch.bool)
    earlier_valid[:, window - past:] = True
    all_k, all_v = torch.cat([earlier_k, keys], 2), torch.cat([earlier_v, values], 2)
    all_valid = torch.cat([earlier_valid, valid], 1)
    out, log_normaliser = window_attention(query, all_k, all_v, all_valid, window, SCALE)
    position = torch.arange(window + length)
    gap = (window + torch.arange(length))[:, None] - position[None, :]
    allowed = (gap >= 0) & (gap < window) & all_valid[:, None, :]
    want, want_log = masked_attention(query, all_k, all_v, allowed)
    real = valid  # padded queries read nothing real: their outputs are never used
    torch.testing.assert_close(out.movedim(3, 1)[real], want.movedim(3, 1)[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(log_normaliser.movedim(3, 1)[real], want_log.movedim(3, 1)[real], rtol=0,
                               atol=1e-12)
    assert torch.isfinite(out).all() and torch.isfinite(log_normaliser).all()  # padded queries too


@pytest.mark.parametrize("window, length, segment", [(4, 11, 1), (4, 11, 2), (3, 12, 3), (1, 7, 2), (5, 11, 1)])
def test_long_inputs_go_a_segment_at_a_time_with_the_same_values(window, length, segment, monkeypatch):
    """SEGMENT_SCORES cut to ``segment`` blocks of w queries a call: output, log normaliser and entropy are those of
    one call over every query (and the banded mask's)."""
    import hf_mixers.kernels.local_attention as module

    query, keys, values, valid = qkv(length=length)
    _, earlier_k, earlier_v, _ = qkv(length=window, seed=1)
    all_k, all_v = torch.cat([earlier_k, keys], 2), torch.cat([earlier_v, values], 2)
    all_valid = torch.cat([torch.ones(3, window, dtype=torch.bool), valid], 1)
    whole = window_attention(query, all_k, all_v, all_valid, window, SCALE, with_entropy=True)
    calls = []
    real_attention = module.window_attention
    monkeypatch.setattr(module, "window_attention",
                        lambda *a, **k: calls.append(a[0].shape[3]) or real_attention(*a, **k))
    monkeypatch.setattr(module, "SEGMENT_SCORES", segment * 3 * 2 * 2 * 2 * window * window)
    parts = module.window_attention(query, all_k, all_v, all_valid, window, SCALE, with_entropy=True)
    assert calls[0] == length and calls[1:] == [min(segment * window, length - start)
                                                for start in range(0, length, segment * window)]
    for got, want in zip(parts, whole, strict=True):
        torch.testing.assert_close(got.movedim(3, 1)[valid], want.movedim(3, 1)[valid], rtol=0, atol=1e-12)


def exact_memory(query, keys, values, valid, extras, state):
    """A memory that keeps every token it is given and reads it with softmax attention: log weight = its log mass."""
    if state is None:
        state = (keys[:, :, :0], values[:, :, :0], valid[:, :0])
    keys, values, valid = (torch.cat(pair, dim) for pair, dim in zip(zip(state, (keys, values, valid)), (2, 2, 1)))
    length, held = query.shape[3], keys.shape[2]
    # query i (of ``length`` new ones) sees the held tokens up to the i-th new one, inclusive
    allowed = (torch.arange(held)[None, :] <= (held - length + torch.arange(length))[:, None]) & valid[:, None, :]
    scores = (torch.einsum("bgjtd,bgsd->bgjts", query, keys) * SCALE).masked_fill(~allowed[:, None, None], -1e300)
    log_weight = torch.logsumexp(scores, -1)
    return torch.einsum("bgjts,bgsd->bgjtd", torch.softmax(scores, -1), values), log_weight, (keys, values, valid)


def full_attention(query, keys, values, valid):
    length = query.shape[3]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return masked_attention(query, keys, values, causal[None] & valid[:, None, :])[0]


@pytest.mark.parametrize("window", [1, 3, 4, 11, 20])
def test_window_plus_an_exact_memory_is_full_attention(window):
    query, keys, values, valid = qkv(length=11)
    out, _ = windowed(query, keys, values, valid, (), None, window, SCALE, exact_memory)
    want = full_attention(query, keys, values, valid)
    torch.testing.assert_close(out.movedim(3, 1)[valid], want.movedim(3, 1)[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("split", [1, 2, 5])
def test_the_window_state_carries_across_calls(split, grad):
    """Prefill of ``split`` tokens then one token at a time (the decode path) equals one call, left padding too;
    without autograd the token steps write the ring buffers in place (the same tensors from step to step)."""
    query, keys, values, valid = qkv(length=11)
    whole, _ = windowed(query, keys, values, valid, (), None, 3, SCALE, exact_memory)
    parts, state = [], None
    with torch.set_grad_enabled(grad):
        for start, stop in [(0, split), *((t, t + 1) for t in range(split, 11))]:
            before = state
            out, state = windowed(query[:, :, :, start:stop], keys[:, :, start:stop], values[:, :, start:stop],
                                  valid[:, start:stop], (), state, 3, SCALE, exact_memory)
            parts.append(out)
            assert state.keys.shape[2] == 3  # the window part of the state stays w tokens long
            if before is not None and stop - start == 1:
                assert (state.keys is before.keys and state.valid is before.valid) == (not grad)
    got = torch.cat(parts, 3)
    torch.testing.assert_close(got.movedim(3, 1)[valid], whole.movedim(3, 1)[valid], rtol=0, atol=1e-12)
    assert state.written.tolist() == [8, 5, 8]  # tokens that have left the window, padding never written
    assert state.oldest.tolist() == [(11 - split) % 3] * 3  # the ring's oldest slot, past the block call's 0



def test_a_prefills_ring_is_views_under_autograd_and_owned_copies_without():
    """The last w tokens a block call leaves in the ring: under autograd views of the call's w + T tensors (a training
    step drops its state; copies would be launches for nothing), without autograd dense copies of w rows that own
    their storage (a prefill's cache). A token step after a prefill under autograd writes a copy of that ring, never
    the prefill's tensors, whose backward still runs."""
    query, keys, values, valid = qkv(length=11)
    keys.requires_grad_()
    out, state = windowed(query, keys, values, valid, (), None, 3, SCALE, exact_memory)
    assert state.keys._base is not None and state.keys.shape[2] == 3
    with torch.no_grad():
        _, owned = windowed(query, keys, values, valid, (), None, 3, SCALE, exact_memory)
    assert all(t._base is None and t.is_contiguous() for t in (owned.keys, owned.values, owned.valid))
    ring = state.keys.detach().clone()
    with torch.no_grad():
        _, after = windowed(query[..., :1, :], keys[:, :, :1], values[:, :, :1], valid[:, :1], (), state, 3, SCALE,
                            exact_memory)
    assert after.keys is not state.keys and torch.equal(state.keys.detach(), ring)
    out.sum().backward()  # (an in-place write into the prefill's tensors would fail it)
    assert keys.grad is not None

def recorded_memory(query, keys, values, valid, extras, state):
    """A memory that keeps every token and extra it is given (to compare what two call patterns wrote) and reads
    a constant: combined by the gate or added."""
    old = state or (keys[:, :, :0], valid[:, :0], tuple(e[:, :, :0] for e in extras))
    state = (torch.cat([old[0], keys], 2), torch.cat([old[1], valid], 1),
             tuple(torch.cat(pair, 2) for pair in zip(old[2], extras, strict=True)))
    return torch.ones_like(query[..., :1]).expand(*query.shape[:-1], values.shape[-1]), None, state


@pytest.mark.parametrize("combine", ["convex", "sum"])
def test_token_steps_and_blocks_in_any_order_equal_one_call(combine):
    """Calls of 4, 1, 1, 3, 1, 1, 1 tokens (a block after token steps reads the ring from its oldest slot, which
    has moved), with per-token extras made from the window's entropy (VORT's order): the same outputs, the same
    tokens and extras written into the memory as one call, under no_grad (the ring written in place)."""
    query, keys, values, valid = qkv(length=12)
    gate = torch.tensor([[-1.0, 0.5], [2.0, 0.0]], dtype=F64)
    features = torch.randn(3, 2, 12, 2, generator=torch.Generator().manual_seed(3), dtype=F64)

    def run(pieces):
        outputs, state, start = [], None, 0
        for size in pieces:
            rows = slice(start, start + size)

            def extras(entropy, rows=rows):  # a feature of the token and a function of its window's entropy
                return features[:, :, rows], entropy.sum(2)

            out, state = windowed(query[:, :, :, rows], keys[:, :, rows], values[:, :, rows], valid[:, rows],
                                  extras, state, 3, SCALE, recorded_memory, gate=gate, combine=combine)
            outputs.append(out)
            start += size
        return torch.cat(outputs, 3), state

    with torch.no_grad():
        whole, whole_state = run([12])
        parts, state = run([4, 1, 1, 3, 1, 1, 1])
    torch.testing.assert_close(parts.movedim(3, 1)[valid], whole.movedim(3, 1)[valid], rtol=0, atol=1e-12)
    written, want = state.memory, whole_state.memory
    assert torch.equal(written[1], want[1])
    torch.testing.assert_close(written[0], want[0], rtol=0, atol=0)
    for got, expected in zip(written[2], want[2], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_memory_without_a_normaliser_is_gated_per_head():
    query, keys, values, valid = qkv(length=9)
    gate = torch.tensor([[-1.0, 0.5], [2.0, 0.0]], dtype=F64)

    def constant_memory(query, keys, values, valid, extras, state):
        return torch.ones_like(query[..., :1]).expand(*query.shape[:-1], values.shape[-1]), None, state

    out, _ = windowed(query, keys, values, valid, (), None, 4, SCALE, constant_memory, gate=gate)
    local = windowed(query, keys, values, valid, (), None, 9, SCALE, exact_memory)[0]  # w >= T: the window alone
    local4, _ = window_attention(query, torch.cat([keys.new_zeros(3, 2, 4, 4), keys], 2),
                                 torch.cat([values.new_zeros(3, 2, 4, 5), values], 2),
                                 torch.cat([torch.zeros(3, 4, dtype=torch.bool), valid], 1), 4, SCALE)
    share = torch.sigmoid(gate)[None, :, :, None, None]
    want = local4 + share * (1.0 - local4)
    written = torch.arange(9)[None, :] >= 4  # from the fifth token on, a token has left the window
    written = written & valid.roll(4, 1)  # ... and it was a real one (row 1 is left-padded by 3)
    want = torch.where(written[:, None, None, :, None], want, local4)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(local.movedim(3, 1)[valid], full_attention(query, keys, values, valid)
                               .movedim(3, 1)[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("readout", ["softmax_count", "sigmoid"])
def test_rsa_log_weight_chunk_form_equals_token_recurrence(readout):
    """RSA's log weight channel (log sum_j mass_j exp(tau q.SK_j)): the chunk form equals the token recurrence and
    the definition, computed from the state after each token."""
    params = make_params(readout=readout, log_weight=True)
    q, k, v, valid = make_inputs(params)
    start = initial_state(params, q.shape[0], v.shape[-1], F64)
    reference, _ = rsa_recurrent(q, k, v, valid, start, params)
    chunked, _ = rsa_chunked(q, k, v, valid, start, params)
    assert chunked.shape[-1] == v.shape[-1] + 1
    torch.testing.assert_close(chunked, reference, rtol=0, atol=1e-10)
    # the definition, for the first 6 tokens of row 0
    state, tau = start, q.shape[-1] ** -0.5
    for t in range(6):
        _, state = rsa_recurrent(q[:1, :, :, t:t + 1], k[:1, :, t:t + 1], v[:1, :, t:t + 1], valid[:1, t:t + 1],
                                 state if t else initial_state(params, 1, v.shape[-1], F64), params)
        slots = (params.kappa[None, :, :, None, None] * params.prototypes[None] + state.key_sum) \
            / (params.kappa[None, :, :, None] + state.mass).clamp_min(params.eps)[..., None]
        scores = tau * torch.einsum("gjd,gmd->gjm", q[0, :, :, t], slots[0, :, 0])
        want = torch.logsumexp(scores + torch.log(state.mass[0, :, 0].clamp_min(params.eps))[:, None], -1)
        torch.testing.assert_close(reference[0, :, :, t, -1], want, rtol=0, atol=1e-10)
