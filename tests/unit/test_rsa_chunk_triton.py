"""The Triton RSA chunk step (kernels/rsa_chunk_triton.py) against the PyTorch chunk form and token recurrence.

Kernel tests run on CUDA, or here under the Triton CPU interpreter in a subprocess (see triton_interpreter.py).
Shapes are small and ragged on purpose: T = 37, d = 12, dv = 10, m = 6 (no size a power of two or a multiple of
the chunk), several KV groups with 2 query heads each; in the batch, left padding (a row of 32 real tokens, which
ends exactly on a chunk boundary, so its references refresh at the end of the call) and a hole.
"""

import functools
from dataclasses import fields, replace

import pytest
import torch

from conftest import fast_then_full, first_in_fast
from triton_interpreter import (DEVICE, compile_key, interpreter_only, needs_kernels, padded_layer_step,
                                record_launches, run_under_interpreter, tf32_dots)

from hf_mixers.apps.bench.precision import relative_error  # `bench precision`'s measure of errors and bounds
from hf_mixers.kernels import rsa_chunk_triton as rct
from hf_mixers.kernels import rsa_chain_triton as rch
from hf_mixers.kernels.rsa_memory import RSAParams, ResidualMLPWeights, initial_state, rsa_chunked, rsa_recurrent
from hf_mixers.kernels.rsa_state import ChunkLayout, ChunkWrites, write_chunks
from hf_mixers.testing import check_step_compiles_whole

DEV = DEVICE or "cpu"  # where the tensors live (the parent process of a CPU machine builds some, launches nothing)
STATE_FIELDS = ("key_sum", "value_sum", "mass", "relation_sum", "key_ref", "value_ref")
KEY_DIM, VALUE_DIM, SLOTS = 12, 10, 6
# the tensors the write hands the read (every_boundary: the sums again, as the bases of the chunk starts' views)
WRITTEN = tuple(f.name for f in fields(ChunkWrites) if f.name != "every_boundary")
BACKWARD = (rct._bwd_sums_kernel, rct._bwd_routing_kernel, rct._bwd_level_kernel, rct._bwd_query_kernel,
            rct._bwd_keys_kernel)


@pytest.mark.variant  # ~3 min of interpreted kernels: the full tier (make test) only
@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
@pytest.mark.parametrize("shard", ["0/2", "1/2"])  # two subprocesses the suite's workers can run side by side
def test_under_interpreter_in_subprocess(shard):
    run_under_interpreter(__file__, shard=shard)


def make_params(groups=2, group_size=2, levels=3, chunk=8, seed=0, query_read=False, **options):
    """fp32 leaves (all requiring grad) on DEV: near-identity W / W_r, thresholds where the relu both passes
    and cuts, non-trivial residual MLPs."""
    g = torch.Generator().manual_seed(seed)
    heads, m = groups * group_size, SLOTS

    def rand(*shape, scale=1.0, shift=0.0, normal=True):
        x = torch.randn(*shape, generator=g) if normal else torch.rand(*shape, generator=g)
        return (x * scale + shift).to(DEV).requires_grad_()

    def mlp(size):
        return ResidualMLPWeights(rand(size, size, scale=0.3), rand(size, scale=0.1), rand(size, size, scale=0.3),
                                  rand(size, scale=0.1))

    eye = torch.eye(m)
    return RSAParams(
        prototypes=rand(groups, levels, m, KEY_DIM), kappa=rand(groups, levels, normal=False, shift=0.5),
        beta=rand(groups, levels, normal=False, shift=0.5), key_mlps=[mlp(KEY_DIM) for _ in range(levels - 1)],
        value_mlps=[mlp(VALUE_DIM) for _ in range(levels - 1)],
        read_proj=(eye + 0.1 * torch.randn(heads, levels, m, m, generator=g)).to(DEV).requires_grad_(),
        mix_proj=(eye + 0.1 * torch.randn(heads, levels, m, m, generator=g)).to(DEV).requires_grad_(),
        threshold=rand(heads, levels, normal=False, scale=0.3), read_scale=rand(heads, levels, normal=False, shift=0.5),
        query_read=rand(heads, levels, KEY_DIM, m) if query_read else None, chunk_size=chunk, **options)


def param_leaves(params):
    leaves = {name: getattr(params, name) for name in ("prototypes", "kappa", "beta", "read_proj", "mix_proj",
                                                       "threshold", "read_scale", "query_read")}
    for kind in ("key_mlps", "value_mlps"):
        for i, mlp in enumerate(getattr(params, kind)):
            leaves.update({f"{kind}[{i}].{n}": getattr(mlp, n) for n in ("up_weight", "up_bias", "down_weight",
                                                                          "down_bias")})
    return {name: t for name, t in leaves.items() if t is not None}


def make_inputs(params, batch=3, length=37, seed=1, dtype=torch.float32):
    groups = params.prototypes.shape[0]
    group_size = params.read_proj.shape[0] // groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, groups, group_size, length, KEY_DIM, generator=g)
    k = torch.randn(batch, groups, length, KEY_DIM, generator=g)
    v = torch.randn(batch, groups, length, VALUE_DIM, generator=g)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if batch > 1:
        valid[1, :length - 32] = False  # left padding; 32 real tokens: the row ends on a chunk boundary (refresh)
    if batch > 2:
        valid[2, 20] = False  # a hole
    q, k, v = (t.to(DEV, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, valid.to(DEV)


def run(fn, params, q, k, v, valid, state, extra_leaves=()):
    """Output, new state and the gradients of a loss that reads the output *and* every returned state tensor
    (so the write side's gradients through the carried state are checked too)."""
    out, new_state = fn(q, k, v, valid, state, params)
    g = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=g).to(out.device)).sum()
    for name in STATE_FIELDS:
        tensor = getattr(new_state, name)
        loss = loss + 0.1 * (tensor * torch.randn(tensor.shape, generator=g).to(tensor.device)).sum()
    leaves = {"q": q, "k": k, "v": v, **param_leaves(params), **dict(extra_leaves)}
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, new_state, dict(zip(leaves, grads))


def assert_close(actual, expected, name, rtol=1e-4, atol=1e-5):
    """rtol per element, atol relative to the tensor's largest entry (near-zero entries of large gradients)."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * max(scale, 1.0),
                               msg=lambda m: f"{name}: {m}")


def assert_matches(params, inputs, state, extra_leaves=(), **tolerances):
    out, new_state, grads = run(rct.rsa_chunked_triton, params, *inputs, state, extra_leaves)
    ref, ref_state, ref_grads = run(rsa_chunked, params, *inputs, state, extra_leaves)
    assert out.dtype == torch.float32
    assert_close(out, ref, "output", **tolerances)
    for name in STATE_FIELDS:
        assert_close(getattr(new_state, name), getattr(ref_state, name), name, **tolerances)
    assert torch.equal(new_state.count, ref_state.count)
    for name, grad in grads.items():
        assert grad is not None, name
        assert_close(grad.float(), ref_grads[name].float(), f"d {name}", **tolerances)
    return out, new_state, grads


@interpreter_only
def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    assert all(isinstance(kernel, InterpretedFunction)
               for kernel in (rct._weights_kernel, rct._values_kernel, *BACKWARD))


@needs_kernels
@pytest.mark.variant  # 12 s under the interpreter: the full tier only
def test_converted_default_matches_reference():
    """convert()'s options (softmax assign, softmax_count readout, relation routing, no RSA-q, no decay): output,
    state and every gradient equal rsa_chunked; the output also equals the token recurrence; without autograd (a
    prefill) the same values. Chunks of 16 (the other tests' are
    8: those options at 8 cost 33 s interpreted)."""
    params = make_params(chunk=16, readout="softmax_count")
    inputs = make_inputs(params)
    state = initial_state(params, 3, VALUE_DIM, torch.float32)
    out, new_state, _ = assert_matches(params, inputs, state)
    with torch.no_grad():
        token, token_state = rsa_recurrent(*inputs, state, params)
        assert_close(rct.rsa_chunked_triton(*inputs, state, params)[0], out, "output without autograd")
    assert_close(out, token, "output vs token recurrence")
    assert_close(new_state.key_sum, token_state.key_sum, "key_sum vs token recurrence")
    assert torch.count_nonzero(out[1, ..., :5, :]) == 0  # padded positions output 0


@needs_kernels
@pytest.mark.parametrize("assign_fn", ["softmax", "sigmoid"])
def test_chain_kernel_equals_assign_chain(assign_fn):
    """One level's assignment chain (kernels/rsa_chain_triton.py) against its PyTorch twin (rsa_state.assign_chain,
    fp64): the assignments, the residual weights, the sums at every boundary, and the gradients of all of them
    through the chain (the keys, the starting sums, mass and references, kappa P, kappa, beta), with rows at three
    phases (counts 0, 5, 13), left padding, a hole, a starting state away from zero, ragged sizes."""
    from hf_mixers.kernels.rsa_chain_triton import assign_chain_triton
    from hf_mixers.kernels.rsa_state import assign_chain, boundary_index

    params = make_params(chunk=8, levels=1, assign_fn=assign_fn)
    _, k, _, valid = make_inputs(params)
    g = torch.Generator().manual_seed(5)
    count = torch.tensor([0, 5, 13])
    layout = ChunkLayout.of(valid, count.to(DEV), params.chunk_size, valid.shape[1])
    k_b, valid_b = layout.pack(k.detach(), 2), layout.valid(3, DEV)
    boundary = boundary_index(layout, params.chunk_size)
    batch, groups, padded, _ = k_b.shape
    chunks = padded // params.chunk_size
    leaves = [k_b, torch.rand(batch, groups, SLOTS, KEY_DIM, generator=g), 2 * torch.rand(batch, groups, SLOTS,
                                                                                           generator=g),
              torch.randn(batch, groups, SLOTS, KEY_DIM, generator=g), torch.randn(groups, SLOTS, KEY_DIM, generator=g),
              torch.rand(groups, generator=g) + 0.5, torch.rand(groups, generator=g) + 0.5]
    leaves = [t.detach().to(DEV, torch.float64) for t in leaves]
    # rows past a row's last boundary hold only padding, whose assignments nothing downstream differentiates
    live = (torch.arange(padded, device=DEV) < (boundary[:, -1:] + 1) * params.chunk_size)[:, None, :, None]
    weights = [torch.randn(batch, groups, padded, SLOTS, generator=g).to(DEV) * live for _ in range(2)] + [
        torch.randn(batch, groups, chunks + 1, SLOTS, KEY_DIM, generator=g).to(DEV),
        torch.randn(batch, groups, chunks + 1, SLOTS, generator=g).to(DEV)]

    def outputs_and_grads(chain, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in leaves]
        outputs = chain(inputs[0], valid_b.to(dtype), *inputs[1:], boundary, params)
        loss = sum((out * w.to(dtype)).sum() for out, w in zip(outputs, weights))
        return outputs, torch.autograd.grad(loss, inputs)

    expected, expected_grads = outputs_and_grads(assign_chain, torch.float64)
    actual, actual_grads = outputs_and_grads(assign_chain_triton, torch.float32)
    for name, out, ref in zip(("f", "p", "key sums", "masses"), actual, expected):
        mask = live if name in ("f", "p") else True
        assert_close((out.double() * mask).float(), (ref * mask).float(), name)
    for name, grad, ref in zip(("x", "key_sum", "mass", "key_ref", "prior", "kappa", "beta"), actual_grads,
                               expected_grads):
        assert_close(grad.float(), ref.float(), f"d {name}")


@needs_kernels
@pytest.mark.parametrize("assign_fn, level, residual, kept", [
    ("softmax", 0, True, True), ("sigmoid", 1, True, True), ("softmax", 2, False, True), ("sigmoid", 0, False, True),
    ("softmax", 1, True, False)])  # kept False: the loss reads no kept reference, as a training step's
def test_level_kernel_equals_level_writes(assign_fn, level, residual, kept):
    """The rest of one level's write (kernels/rsa_chain_triton.py's level kernel) against its PyTorch twin
    (rsa_state.level_writes, fp64): what it writes, the value and relation sums at every boundary, the next level's
    residual inputs, the references the state keeps, and every gradient (f, p, x, y, the chain's sums and masses,
    the starting state, kappa P, kappa, the level above's assignments), over every row (padding and chunks past a
    row's last boundary included), with rows at three phases (counts 0, 5, 13), left padding, a hole, a slot of zero
    mass, ragged sizes; level 0 (no relation) and deeper, with and without the residual (the last level), and with
    a loss that does not read the references the state keeps (their gradients not given: no zeros made for them)."""
    from hf_mixers.kernels.rsa_chain_triton import level_writes_triton
    from hf_mixers.kernels.rsa_state import boundary_index, level_writes

    params = make_params(chunk=8, levels=1, assign_fn=assign_fn)
    _, k, v, valid = make_inputs(params)
    g = torch.Generator().manual_seed(6)
    layout = ChunkLayout.of(valid, torch.tensor([0, 5, 13]).to(DEV), params.chunk_size, valid.shape[1])
    valid_b, boundary = layout.valid(3, DEV), boundary_index(layout, params.chunk_size)
    batch, groups, padded = 3, 2, layout.padded
    chunks = padded // params.chunk_size
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    mass = 2 * rand(batch, groups, chunks + 1, SLOTS)
    mass[:, :, 0, 0] = 0.0  # an empty slot: its value reference is clamped
    leaves = {"f": torch.softmax(randn(batch, groups, padded, SLOTS), -1), "p": rand(batch, groups, padded, SLOTS),
              "x": randn(batch, groups, padded, KEY_DIM), "y": randn(batch, groups, padded, VALUE_DIM),
              "key_sum": randn(batch, groups, chunks + 1, SLOTS, KEY_DIM), "mass": mass,
              "value_sum": randn(batch, groups, SLOTS, VALUE_DIM), "key_ref": randn(batch, groups, SLOTS, KEY_DIM),
              "value_ref": randn(batch, groups, SLOTS, VALUE_DIM), "prior": randn(groups, SLOTS, KEY_DIM),
              "kappa": rand(groups) + 0.5, "f_above": rand(batch, groups, padded, SLOTS) * valid_b[:, None, :, None],
              "relation_sum": rand(batch, groups, SLOTS, SLOTS)}
    if level == 0:
        leaves.pop("f_above"), leaves.pop("relation_sum")
    if assign_fn == "softmax":
        leaves.pop("p")
    leaves = {name: t.to(DEV, torch.float64) for name, t in leaves.items()}

    def outputs_and_grads(level_fn, dtype):
        inputs = {name: t.to(dtype).requires_grad_() for name, t in leaves.items()}
        above = (inputs["f_above"], inputs["relation_sum"]) if level else (None, None)
        outputs = level_fn(inputs["f"], inputs.get("p", inputs["f"]), inputs["x"], inputs["y"], valid_b.to(dtype),
                           inputs["key_sum"], inputs["mass"], inputs["value_sum"], inputs["key_ref"],
                           inputs["value_ref"], inputs["prior"], inputs["kappa"], boundary, params, *above,
                           residual=residual)
        outputs = [out for out in outputs if out is not None]
        weights = torch.Generator().manual_seed(8)
        read = outputs if kept else outputs[:-2]  # the kept key and value references come last
        loss = sum((out * torch.randn(out.shape, generator=weights).to(DEV, dtype)).sum() for out in read)
        used = [name for name in inputs if residual or name not in ("x", "p")]
        return outputs, dict(zip(used, torch.autograd.grad(loss, [inputs[name] for name in used])))

    expected, expected_grads = outputs_and_grads(level_writes, torch.float64)
    actual, actual_grads = outputs_and_grads(level_writes_triton, torch.float32)
    assert len(actual) == len(expected) == 4 + (level > 0) + 2 * residual
    for index, (out, ref) in enumerate(zip(actual, expected)):
        assert_close(out.float(), ref.float(), f"output {index}")
    for name, ref in expected_grads.items():
        assert_close(actual_grads[name].float(), ref.float(), f"d {name}")


@needs_kernels
def test_the_chain_kernel_writes_every_level_with_and_without_autograd(monkeypatch):
    """Each level's assignment chain is one launch of kernels/rsa_chain_triton.py, in training (forward, then one
    backward launch a level) and in a no-grad prefill alike: no loop over chunks on the host."""
    calls = []
    for kernel in (rch._chain_fwd, rch._chain_bwd):
        real = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _real=real, _name=kernel.fn.__name__, **k: (
            calls.append(_name), _real(*a, **k))[1])
    params = make_params(chunk=8, levels=2)
    inputs = make_inputs(params, batch=2)
    state = initial_state(params, 2, VALUE_DIM, torch.float32)
    run(rct.rsa_chunked_triton, params, *inputs, state)
    assert calls == ["_chain_fwd"] * 2 + ["_chain_bwd"] * 2, calls
    calls.clear()
    with torch.no_grad():
        rct.rsa_chunked_triton(*inputs, state, params)
    assert calls == ["_chain_fwd"] * 2


@needs_kernels
@pytest.mark.parametrize("assign_fn, readout, routing, query_read", first_in_fast(
    ("sigmoid", "sigmoid", "elementwise", True),
    ("softmax", "softmax_count", "none", True),
    ("softmax", "sigmoid", "relation", True),
))
def test_options_match_reference(assign_fn, readout, routing, query_read):
    params = make_params(chunk=16, assign_fn=assign_fn, readout=readout, routing=routing, query_read=query_read)
    inputs = make_inputs(params, batch=2)
    assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))


@needs_kernels
def test_the_kernels_clamp_theta_and_its_gradient_as_the_reference_does():
    """theta as learned, below 0, inside and above ``threshold_max``: the read kernels clamp it themselves (no clamp
    op before them) and pass its gradient only where the clamp passes it, as the PyTorch form's clamp does."""
    params = make_params(levels=2, chunk=8, readout="softmax_count")
    learned = torch.tensor([-0.2, 0.1, 0.45, 0.3, 0.0, 0.25, -0.1, 0.2])
    params = replace(params, threshold=learned.view_as(params.threshold).to(DEV).requires_grad_(), threshold_max=0.3)
    inputs = make_inputs(params, batch=2, length=24)
    grads = assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))[2]["threshold"]
    outside = (params.threshold < 0) | (params.threshold > 0.3)
    assert outside.any() and torch.all(grads[outside] == 0) and torch.all(grads[~outside] != 0), grads


@needs_kernels
def test_an_unpadded_first_call_matches_reference_in_the_static_layout():
    """No mask and a fresh state (a training step; with a window, the memory's part past its delay): the buffer is
    the sequence padded at its end to whole chunks (``ChunkLayout.of(None, ..., fresh=True)``: no mask, no gathers),
    each row's last boundary read from it by the chain and level kernels. Output, state and every gradient equal the
    PyTorch path's, there given an all-ones mask (the masked layout), at a length that leaves a part chunk."""
    params = make_params(chunk=8, routing="relation", log_weight=True)
    q, k, v, _ = make_inputs(params, batch=2, length=29)
    state = initial_state(params, 2, VALUE_DIM, torch.float32)
    out, new_state, grads = run(functools.partial(rct.rsa_chunked_triton, fresh=True), params, q, k, v, None, state)
    ref, ref_state, ref_grads = run(rsa_chunked, params, q, k, v, torch.ones(2, 29, dtype=torch.bool, device=DEV),
                                    state)
    assert_close(out, ref, "output")
    for name in STATE_FIELDS:
        assert_close(getattr(new_state, name), getattr(ref_state, name), name)
    for name, grad in grads.items():
        assert_close(grad.float(), ref_grads[name].float(), f"d {name}")


@needs_kernels
def test_a_second_backward_through_the_graph_gives_the_same_gradients():
    """The read's backward takes what its forward saved (chains, numerator, normaliser) and writes only buffers of
    its own (c~ has its own plane), so a graph kept with ``retain_graph`` differentiates twice to the same result."""
    params = make_params(chunk=16, routing="relation", log_weight=True)
    q, k, v, valid = make_inputs(params, batch=2)
    out, _ = rct.rsa_chunked_triton(q, k, v, valid, initial_state(params, 2, VALUE_DIM, torch.float32), params)
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum()
    leaves = [q, k, v, *param_leaves(params).values()]
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for index, (a, b) in enumerate(zip(first, second)):  # close, not equal: a GPU's fp32 atomics add in any order
        assert_close(b, a, f"gradient {index}, second backward")


@needs_kernels
@pytest.mark.parametrize("readout, routing", first_in_fast(("softmax_count", "relation"), ("sigmoid", "elementwise")))
def test_log_weight_matches_reference(readout, routing):
    """The local window's merge weight (``params.log_weight``, one more output channel): its value and its share of
    every gradient (the loss weighs the extra channel) equal rsa_chunked, with the read in the other channels."""
    params = make_params(chunk=16, readout=readout, routing=routing, log_weight=True)
    inputs = make_inputs(params, batch=2)  # left padding included
    out, *_ = assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))
    assert out.shape[-1] == VALUE_DIM + 1 and torch.isfinite(out).all()


@needs_kernels
def test_the_read_ops_outputs_have_the_shapes_of_its_fake(monkeypatch):
    """torch.compile traces the read op through its fake (``register_fake``), so the real op's outputs must have
    the fake's shapes: with a backward to save for, and without one, where the chains, numerator and normaliser
    are 0-size (the normaliser the kernels need then is a buffer of their own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls, real = [], rct._read_forward

    def read_forward(inputs, *options):
        outputs = real(inputs, *options)
        calls.append((inputs, options, outputs))
        return outputs

    monkeypatch.setattr(rct, "_read_forward", read_forward)
    params = make_params(chunk=16, log_weight=True)
    q, k, v, valid = make_inputs(params, batch=2)
    state = initial_state(params, 2, VALUE_DIM, torch.float32)
    rct.rsa_chunked_triton(q, k, v, valid, state, params)
    with torch.no_grad():
        rct.rsa_chunked_triton(q, k, v, valid, state, params)
    assert [options[-1] for _, options, _ in calls] == [True, False]  # a backward follows, then none
    for inputs, options, outputs in calls:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = real([mode.from_tensor(t.detach()) for t in inputs], *options)
        assert [t.shape for t in outputs] == [t.shape for t in fakes], options
    assert [t.numel() for t in calls[1][2][1:]] == [0, 0, 0]


@needs_kernels
@pytest.mark.parametrize("levels", first_in_fast(3, 1))
def test_warmups_are_exactly_what_the_call_launches(levels, monkeypatch):
    """``_Read.warmups`` (compiled side by side before the first launch on CUDA, kernels/triton_compile.py) names
    every kernel variant a training call then launches, with the same argument kinds and constexprs: none missing (it
    would compile at its launch, in turn) and none extra (minutes of compile for nothing)."""
    launched, warmed = record_launches(monkeypatch, (rct._weights_kernel, rct._values_kernel, *BACKWARD)), set()
    launched.run = False  # what is launched, not its values
    monkeypatch.setattr(rct._Read, "compile_kernels", lambda read, inputs, backward: warmed.update(
        compile_key(kernel, args, constexprs) for kernel, _, args, constexprs in read.warmups(inputs, backward)))
    params = make_params(chunk=16, levels=levels, query_read=True, log_weight=True)
    inputs = make_inputs(params, batch=2)
    run(rct.rsa_chunked_triton, params, *inputs, initial_state(params, 2, VALUE_DIM, torch.float32))
    assert launched and warmed == launched
    # the forward's two; the backward's sums, [the relation routing's,] level 0's [and the other levels'], the query
    # side's and the keys'
    assert len(launched) == (6 if levels == 1 else 8)


@needs_kernels
@pytest.mark.parametrize("readout, routing, query_read", first_in_fast(("softmax_count", "relation", True),
                                                                      ("sigmoid", "elementwise", False)))
def test_the_read_over_feature_blocks_matches_reference(readout, routing, query_read, monkeypatch):
    """The kernels take the key (forward and backward) and value (backward) features, and the slots of their
    products read back from memory, FEATURE_BLOCK at a time (so Llama-3-8B's 128-wide heads keep their tiles
    narrow): cut to 4, the key dim 12, value dim 10 and 6 slots take 3, 3 and 2 blocks, the last two ragged; the
    values kernel's programs VALUE_BLOCK value features each: cut to 8, two programs, the second ragged. Output,
    state and every gradient still equal rsa_chunked, the window's merge weight included."""
    monkeypatch.setattr(rct, "FEATURE_BLOCK", 4)
    monkeypatch.setattr(rct, "VALUE_BLOCK", 8)
    params = make_params(chunk=16, readout=readout, routing=routing, query_read=query_read, log_weight=True)
    read = rct._Read(rct._read_options(params), torch.zeros(1, 4, 16, KEY_DIM), torch.zeros(1, 2, 3, 16, SLOTS),
                     torch.zeros(1, 2, 3, 16, VALUE_DIM))
    assert read.backward_options["BLOCK"] == read.keys_options["BLOCK"] == 4 < min(KEY_DIM, VALUE_DIM, SLOTS)
    assert read.weights_options["BLOCK_D"] == read.weights_options["BLOCK_S"] == read.values_options["BLOCK_S"] == 4
    assert read.values_options["BLOCK_DV"] == 8 and read.values_grid[2] == 2  # the values kernel's: 8 and 2
    inputs = make_inputs(params, batch=2)
    assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))


@needs_kernels
@pytest.mark.parametrize("readout, routing, query_read", first_in_fast(("softmax_count", "relation", True),
                                                                      ("sigmoid", "elementwise", False)))
def test_forward_over_row_blocks_matches_reference(readout, routing, query_read, monkeypatch):
    """The kernels take a chunk PROGRAM_ROWS rows per program, and the forward reads the chunk's rows KEY_BLOCK at a
    time: both cut to 8 with chunks of 12, each chunk is two programs, the second one ragged, whose rows read the
    chunk's rows up to theirs in two blocks (and, backward, add their share of the chunk's gradients). Three query
    heads a KV head: the values kernel stacks them as four row blocks, the last one masked. Output, state and every
    gradient still equal rsa_chunked, the window's merge weight included."""
    monkeypatch.setattr(rct, "PROGRAM_ROWS", 8)
    monkeypatch.setattr(rct, "KEY_BLOCK", 8)
    params = make_params(chunk=12, group_size=3, readout=readout, routing=routing, query_read=query_read,
                         log_weight=True)
    read = rct._Read(rct._read_options(params), torch.zeros(1, 6, 24, KEY_DIM), torch.zeros(1, 2, 3, 24, SLOTS),
                     torch.zeros(1, 2, 3, 24, VALUE_DIM))
    assert read.grid == (4, 6) and read.weights_options["BLOCK_R"] == read.values_options["BLOCK_R"] == 8
    assert read.values_grid == (4, 2, 1) and read.values_options["BLOCK_G"] == 4
    assert read.backward_options["BLOCK_R"] == 8
    inputs = make_inputs(params, batch=2)
    assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))


@needs_kernels
@pytest.mark.variant  # 9 s under the interpreter: the full tier only
def test_conversion_init_and_single_level():
    """The converted layer at init: W_r = 0 below level 0 (a_i = 0 exactly: |a| has a zero subgradient) and
    theta = 0, 4 levels; and a single level (no routing, no relation sums)."""
    params = make_params(levels=4, chunk=16, readout="softmax_count")
    with torch.no_grad():
        params.mix_proj[:, 1:] = 0.0
        params.threshold.zero_()
    inputs = make_inputs(params, batch=2)
    assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))
    params = make_params(levels=1, chunk=16, routing="relation", query_read=True)
    assert_matches(params, inputs, initial_state(params, 2, VALUE_DIM, torch.float32))


@needs_kernels
@pytest.mark.variant  # 10 s under the interpreter: the full tier only
def test_continues_from_a_non_initial_state():
    """Two calls: a first one that stops mid-chunk, then a second from its state, with gradients into the incoming
    state (sums, references) as well."""
    params = make_params(chunk=8, readout="softmax_count", query_read=True)
    q, k, v, valid = make_inputs(params, batch=2)
    with torch.no_grad():
        _, state = rct.rsa_chunked_triton(q[..., :14, :], k[:, :, :14], v[:, :, :14], valid[:, :14],
                                          initial_state(params, 2, VALUE_DIM, torch.float32), params)
    assert (state.count % 8 != 0).all()  # mid-chunk: the second call starts at a phase
    leaves = {name: getattr(state, name).detach().clone().requires_grad_() for name in STATE_FIELDS}
    state = replace(state, **leaves)
    rest = (q[..., 14:, :], k[:, :, 14:], v[:, :, 14:], valid[:, 14:])
    assert_matches(params, rest, state, extra_leaves=[(f"state.{n}", t) for n, t in leaves.items()])


@needs_kernels
def test_row_without_real_tokens_and_empty_call():
    params = make_params(chunk=8)
    q, k, v, valid = make_inputs(params, batch=2, length=5)
    valid[1] = False
    state = initial_state(params, 2, VALUE_DIM, torch.float32)
    out, new_state, _ = assert_matches(params, (q, k, v, valid), state)
    assert torch.count_nonzero(out[1]) == 0 and new_state.count.tolist() == [5, 0]
    empty, same = rct.rsa_chunked_triton(q[..., :0, :], k[:, :, :0], v[:, :, :0], valid[:, :0], state, params)
    assert empty.shape == (2, 2, 2, 0, VALUE_DIM) and torch.equal(same.mass, state.mass)


@needs_kernels
@pytest.mark.parametrize("dtype", first_in_fast(torch.bfloat16, torch.float16))
def test_half_inputs_accumulate_in_fp32(dtype):
    """Half q, k, v: the same function as fp32 on the same rounded inputs (q is upcast in the kernel, k and v
    before the write side); gradients come back in the input dtype."""
    params = make_params(chunk=16, readout="softmax_count")
    q, k, v, valid = make_inputs(params, batch=2, dtype=dtype)
    state = initial_state(params, 2, VALUE_DIM, torch.float32)
    out, new_state, grads = run(rct.rsa_chunked_triton, params, q, k, v, valid, state)
    assert out.dtype == torch.float32 and [grads[n].dtype for n in "qkv"] == [dtype] * 3
    upcast = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, ref_state, ref_grads = run(rsa_chunked, params, *upcast, valid, state)
    assert_close(out, ref, "output")
    assert_close(new_state.key_sum, ref_state.key_sum, "key_sum")
    for name, grad in grads.items():  # q, k, v gradients are rounded to the input dtype
        assert_close(grad.float(), ref_grads[name], f"d {name}", rtol=2e-2, atol=2e-2)


def test_supports_names_what_is_not_implemented():
    """Every unsupported option comes with its reason, and rsa_chunked_triton raises it. No kernel launch: this
    test also runs in the parent process, where the kernels cannot run (CPU tensors, no interpreter)."""
    params = make_params(chunk=8)
    q = torch.zeros(1, 2, 2, 3, KEY_DIM, device=DEV)
    state = initial_state(params, 1, KEY_DIM, torch.float32)
    if DEVICE is None:
        assert "TRITON_INTERPRET=1" in rct.rsa_chunk_triton_supports(params, q)
        with pytest.raises(NotImplementedError, match="rsa_chunked_triton: cpu tensors: the kernels need CUDA"):
            rct.rsa_chunked_triton(q, q[:, :, 0], q[:, :, 0], None, state, params)
    else:
        assert rct.rsa_chunk_triton_supports(params, q, q[:, :, 0]) is None
    decay = torch.zeros(1, 2, 3, device=DEV)
    assert "decay" in rct.rsa_chunk_triton_supports(params, q, log_decay=decay)
    with pytest.raises(NotImplementedError, match="rsa_chunked_triton: GLA-style decay"):
        rct.rsa_chunked_triton(q, q[:, :, 0], q[:, :, 0], None, state, params, log_decay=decay)
    assert "dtype torch.float64" in rct.rsa_chunk_triton_supports(params, q.double())
    cases = {"readout": ("softmax", "readout 'softmax'"), "routing": ("dense", "routing 'dense'"),
             "assign_fn": ("argmax", "assign_fn 'argmax'"), "chunk_size": (256, "chunk_size 256 > 64")}
    for field, (value, message) in cases.items():
        assert message in rct.rsa_chunk_triton_supports(replace(params, **{field: value})), field
    wide = torch.zeros(1, 2, 3, 200, device=DEV)
    assert "value head dim 200 > 128" in rct.rsa_chunk_triton_supports(params, v=wide)
    assert rct.rsa_chunk_triton_supports(params, v=wide[..., :128]) is None  # Llama-3-8B's heads
    # the chain kernel's scope is the read's (one reason for both)
    assert "decay" in rch.scope_reason(params, log_decay=decay)
    assert "key head dim 200 > 128" in rch.scope_reason(replace(params, prototypes=torch.zeros(2, 3, SLOTS, 200)))


@needs_kernels
@pytest.mark.parametrize("window", first_in_fast(0, 4))
def test_rsa_model_on_the_triton_path_equals_the_pytorch_path(window):
    """The dispatch end to end: a tiny RSA model with kernel_backend="triton" gives the logits and gradients of the
    same model on the PyTorch path (left-padded batch), and its prefill + token-by-token decode the full forward;
    also with the local window (rsa_window), whose merge takes the kernel's log weight."""
    from conftest import step_through, tiny_config
    from hf_mixers import RSAConfig, RSAForCausalLM

    models = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        models[backend] = RSAForCausalLM(tiny_config(RSAConfig, kernel_backend=backend, rsa_num_levels=2,
                                                     rsa_num_slots=8, rsa_chunk_size=8, rsa_window=window)).to(DEV)
    ids = torch.randint(1, 101, (2, 21), generator=torch.Generator().manual_seed(0)).to(DEV)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    results = {}
    for backend, model in models.items():
        logits = model(ids, attention_mask=mask).logits
        logits[mask.bool()].pow(2).mean().backward()
        results[backend] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-4, atol=1e-5)
    assert results["triton"][1].keys() == results["torch"][1].keys()
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    decoded, _ = step_through(models["triton"].eval(), ids, mask, prefill=13)  # prefill 13 (two chunks), decode 8
    torch.testing.assert_close(decoded[mask.bool()], results["triton"][0][mask.bool()], rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.variant  # ~15 s under the interpreter (the conversion's forwards): the full tier only
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the unrecorded kernels run on garbage
def test_the_gpu_checks_warm_up_compiles_what_the_demos_conversion_and_training_launch(tmp_path, monkeypatch):
    """`make gpu-check` compiles the RSA variants before its timed steps (scripts/gpu_check.py ``warm_kernel``, via
    bench kernels' ``_candidate``). Each readout is its own variant: warming the mixer's default (sigmoid) while the
    conversion sets the count-aware softmax left the demo's forward and backward to compile inside the distillation
    on the fourth H100 run (38 s each). Here the launches of a converted teacher's calibration and training step
    (the demo's window) are exactly those of the warm-up at the same head layout, the no-grad launches (the
    conversion's forwards) included. The report's cache measurement is left out: its prefills (64-256
    tokens, 40 s interpreted) launch the no-grad variant of the held-out evaluation's."""
    from conftest import save_tiny_teacher
    from hf_mixers.apps.bench.kernels import _candidate
    from hf_mixers.conversion import convert, converter

    monkeypatch.setattr(converter, "cache_bytes_at", lambda model, contexts, *args: dict.fromkeys(contexts, 0))
    save_tiny_teacher(tmp_path / "teacher")
    launched = record_launches(monkeypatch, (rct._weights_kernel, rct._values_kernel, *BACKWARD, rch._chain_fwd,
                                             rch._chain_bwd))
    student, _ = convert(str(tmp_path / "teacher"), "rsa", mixer_options={"rsa_window": 8}, sequence_length=48,
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    launched.run = False  # from here what is launched is the question, not its values (minutes interpreted)
    student.to(DEV).train()
    student(torch.randint(1, 50, (1, 24), device=DEV)).logits.float().pow(2).mean().backward()
    demo = set(launched)
    launched.clear()
    shape = dict(heads=4, kv_heads=2, head_dim=16)  # the tiny teacher's heads (hidden 64)
    _, run_warm = _candidate("rsa_triton", shape, 40, DEV, torch.float32, torch.Generator().manual_seed(0), 64,
                             {"rsa_window": 8})
    with torch.no_grad():
        run_warm()
    run_warm().pow(2).mean().backward()
    # the chain forward and backward, the read forward's two, its backward's sums, routing, levels (level 0, the
    # others), query side and keys
    assert len(demo) == 10 and launched == demo


@needs_kernels
@pytest.mark.parametrize("options", fast_then_full({}, {"rsa_assign_fn": "sigmoid", "rsa_window": 8}))
def test_the_layers_kernel_step_is_one_graph_for_torch_compile(options):
    """The chain, level and read kernels are torch.library ops (forward and backward), so an RSA layer's training
    step on the kernels compiles with ``fullgraph=True`` (a left-padded batch; the full tier with the sigmoid
    assignment, a constexpr of the same ops, and the local window, which adds its branch and the read's merge weight)
    and gives the output and input gradient of the same layer on the PyTorch path: on a GPU it can be captured
    whole."""
    options = {"rsa_readout": "softmax_count", "rsa_chunk_size": 16, "rsa_num_slots": 16, **options}

    def layer(backend):  # one seed: the same weights and input on either path
        torch.manual_seed(0)
        return padded_layer_step("rsa", {**options, "kernel_backend": backend}, 64, 40)[:2]

    (step, x), (reference, x_reference) = layer("triton"), layer("torch")
    assert torch.equal(x, x_reference)
    check_step_compiles_whole(step, x, reference=reference)


def _write_leaves(params, k, v):
    """The write side's inputs and parameters by name (what its gradients reach): ``param_leaves``' less the read's."""
    written = ("prototypes", "kappa", "beta", "key_mlps", "value_mlps")
    return {"k": k, "v": v, **{name: t for name, t in param_leaves(params).items() if name.startswith(written)}}


def _with_leaves(params, leaves):
    """``params`` with the tensors ``leaves`` names (``param_leaves``' names) replaced by them, the others kept."""
    mlps = {kind: [ResidualMLPWeights(*(leaves.get(f"{kind}[{i}].{n}", getattr(mlp, n))
                                        for n in ("up_weight", "up_bias", "down_weight", "down_bias")))
                   for i, mlp in enumerate(getattr(params, kind))] for kind in ("key_mlps", "value_mlps")}
    tensors = {name: t for name, t in leaves.items() if "[" not in name and name not in ("q", "k", "v")}
    return replace(params, **tensors, **mlps)


@needs_kernels
def test_a_half_precision_write_takes_tf32_dots_within_the_bf16_bound(monkeypatch):
    """A bf16 / fp16 call's write (chain, level and residual MLP kernels) takes plain tf32 dots, an fp32 call's
    fp32-accurate ones, and so the read's weights; the read's sums fp32-accurate ones always (``rsa_memory`` decides
    from the inputs' dtype before it casts them; ``conventions.dot_precision``). Issue 67's criterion on the kernels
    themselves, their dots rounded as a tensor core rounds them (``tf32_dots``): every quantity the write hands on
    (assignments, the levels' keys and values, the sums at every boundary, the final state) and every gradient of
    its inputs and parameters stay within the bf16 bound -- the error the exact (fp64) write makes from its inputs
    and parameters rounded to bf16. Three levels, left padding, a hole."""
    from functools import partial

    from hf_mixers.kernels.rsa_chain_triton import assign_chain_triton, level_writes_triton
    from hf_mixers.kernels.rsa_memory import rsa_memory
    from hf_mixers.kernels.rsa_mlp_triton import residual_mlps_triton

    params = make_params(chunk=8, levels=3)
    _, k, v, valid = make_inputs(params, length=45)
    layout = ChunkLayout.of(valid, torch.zeros(3, dtype=torch.long, device=DEV), params.chunk_size, valid.shape[1])
    valid_b = layout.valid(3, DEV)
    names = list(_write_leaves(params, k, v))
    probe = torch.Generator().manual_seed(9)

    def write(values, dtype, **kernels):
        """The write's outputs and the gradients of a fixed probe of them, from ``values`` cast to ``dtype``."""
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in values.items()}
        state = initial_state(params, 3, VALUE_DIM, dtype)
        writes, final = write_chunks(layout.pack(leaves["k"], 2), layout.pack(leaves["v"], 2), valid_b, layout,
                                     state, _with_leaves(params, leaves), **kernels)
        outputs = [getattr(writes, n) for n in WRITTEN] + [getattr(final, n) for n in STATE_FIELDS]
        weights = [torch.randn(out.shape, generator=probe.manual_seed(9 + i), dtype=torch.float64).to(DEV)
                   for i, out in enumerate(outputs)]
        for i in range(3):  # f, x, y (B, G, L, Tp, .): real rows only, as the read takes them (F = 0 on padding)
            weights[i] = weights[i] * valid_b[:, None, None, :, None]
        loss = sum((out.double() * w).sum() for out, w in zip(outputs, weights))
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        return [out.detach().double() for out in outputs] + [g.double() for g in grads]

    original = _write_leaves(params, k, v)
    rounded = {n: t.detach().to(torch.bfloat16).float() for n, t in original.items()}
    reference = write(rounded, torch.float64)
    bound = [relative_error(a, b) for a, b in zip(reference, write(original, torch.float64))]
    tf32_dots(monkeypatch)
    kernels = {name: partial(fn, precision="tf32") for name, fn in (
        ("chain", assign_chain_triton), ("level", level_writes_triton), ("mlps", residual_mlps_triton))}
    actual = write(rounded, torch.float32, **kernels)
    labels = list(WRITTEN) + [f"final {n}" for n in STATE_FIELDS] + [f"d {n}" for n in names]
    assert len(labels) == len(actual) == len(reference) == len(bound)
    for label, a, b, limit in zip(labels, actual, reference, bound):
        error = relative_error(a, b)  # (fp32-accurate dots: 1e-4 of the bound; tf32 within a quarter of it)
        assert 0 < error <= limit, f"{label}: tf32 error {error:.3g} over the bf16 bound {limit:.3g}"

    launched = record_launches(monkeypatch, (rct._weights_kernel, rct._values_kernel, rch._chain_fwd,
                                             rch._level_sums_fwd))
    q = torch.randn(3, 2, 2, 45, KEY_DIM, device=DEV)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            launched.clear()
            rsa_memory(q.to(dtype), k.detach().to(dtype), v.detach().to(dtype), valid,
                       initial_state(params, 3, VALUE_DIM, torch.float32), params, backend="triton")
            write_precision = "tf32x3" if dtype == torch.float32 else "tf32"  # the precision each kernel took
            precisions = {(name, dict(constexprs)["PRECISION"], dict(constexprs).get("WEIGHT_PRECISION"))
                          for name, _, constexprs in launched}
            assert precisions == {("_weights_kernel", "tf32x3", write_precision), ("_values_kernel", "tf32x3", None),
                                  ("_chain_fwd", write_precision, None), ("_level_sums_fwd", write_precision, None)}, \
                (dtype, precisions)


@needs_kernels
def test_a_half_precision_memory_takes_tf32_dots_within_the_bf16_bound(monkeypatch):
    """The whole chunked memory of a bf16 / fp16 call on the kernels, their dots rounded as a tensor core rounds
    them (``tf32_dots``): tf32 in the write and in the read's weights (scores, slot mixing, routing), fp32-accurate
    in the read's sums (masses, values). Its output, the state it hands on and every gradient stay within the bf16
    bound -- the error the exact (fp64) PyTorch form makes from its inputs and parameters rounded to bf16. Three
    levels with the relation routing, left padding, a hole. (Which products need fp32-accurate operands shows at
    8K tokens, not at this size: `hf-mixers bench precision`, docs/benchmarks.md.)"""
    params = make_params(chunk=8, levels=3)
    original = {**dict(zip("qkv", make_inputs(params, length=45)[:3])), **param_leaves(params)}
    valid = make_inputs(params, length=45)[3]

    def step(values, fn, dtype):
        """Output, new state and ``run``'s gradients, from ``values`` cast to ``dtype`` (leaves of their own)."""
        leaves = {name: t.detach().to(dtype).requires_grad_() for name, t in values.items()}
        out, state, grads = run(fn, _with_leaves(params, leaves), leaves["q"], leaves["k"], leaves["v"], valid,
                                initial_state(params, 3, VALUE_DIM, dtype))
        return {name: t.detach() for name, t in (("output", out), *((n, getattr(state, n)) for n in STATE_FIELDS),
                                                 *((f"d {n}", grad) for n, grad in grads.items()))}

    rounded = {name: t.detach().to(torch.bfloat16).float() for name, t in original.items()}
    reference = step(rounded, rsa_chunked, torch.float64)
    bound = {name: relative_error(reference[name], exact) for name, exact in
             step(original, rsa_chunked, torch.float64).items()}
    tf32_dots(monkeypatch)
    actual = step(rounded, functools.partial(rct.rsa_chunked_triton, precision="tf32"), torch.float32)
    assert actual.keys() == reference.keys() == bound.keys()
    for name, value in actual.items():
        error = relative_error(value, reference[name])
        assert 0 < error <= bound[name], f"{name}: tf32 error {error:.3g} over the bf16 bound {bound[name]:.3g}"

