"""The Triton feedback solve (kernels/feedback_solve_triton.py) against the dense reference.

Kernel tests run on CUDA, or on a CPU machine under the Triton interpreter in a fresh pytest process started with
TRITON_INTERPRET=1 (tests/triton_interpreter.py says why and how).
"""

import pytest
import torch

from conftest import first_in_fast
from triton_interpreter import (DEVICE, compile_key, interpreter_only, needs_kernels, record_launches,  # skips
                                run_under_interpreter, tf32_dots)  # without triton
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from hf_mixers.apps.bench.precision import relative_error  # `bench precision`'s measure of errors and bounds
from hf_mixers.kernels.conventions import dot_precision
from hf_mixers.kernels.feedback_solve import feedback_solve_dense

if DEVICE is not None:
    from hf_mixers.kernels import feedback_solve_triton as fst

    solve = fst.feedback_solve_triton


@pytest.mark.variant  # ~25 s of interpreted kernels: the full tier (make test) only
@pytest.mark.skipif(DEVICE is not None, reason="the kernel tests run in this process")
def test_under_interpreter_in_subprocess():
    run_under_interpreter(__file__)


B, T, D, KD = 3, 37, 20, 12  # ragged on purpose: no size is a multiple of a block


def make_inputs(batch=B, length=T, width=D, key_dim=KD, past=0, padded=True, seed=0, dtype=torch.float32,
                gain_scale=0.9):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()

    f, q, k = randn(batch, length, width), randn(batch, length, key_dim), randn(batch, length, key_dim)
    gain = ((torch.rand(batch, length, generator=g) * 2 - 1) * gain_scale).to(DEVICE, dtype).requires_grad_()
    mask = torch.ones(batch, past + length, dtype=torch.bool, device=DEVICE)
    if padded:
        mask[0, : past + 3] = False  # left padding: sequence 0's whole cache and first 3 new tokens
        mask[-1, past + length // 2] = False  # a hole
    past_k = randn(batch, past, key_dim) if past else None
    past_s = randn(batch, past, width) if past else None
    return dict(f=f, q=q, k=k, gain=gain, key_mask=mask, past_k=past_k, past_s=past_s)


def _leaves(inputs):
    return [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _values_and_grads(fn, inputs, **kwargs):
    out = fn(**inputs, **kwargs)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    return out, torch.autograd.grad((out * probe).sum(), _leaves(inputs))


def _assert_close(actual, expected, rtol=1e-4, atol=1e-5, **kwargs):
    """rtol per element, atol relative to the tensor's largest entry (near-zero entries of large gradients)."""
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * max(scale, 1.0), **kwargs)


def _assert_matches_dense(inputs, **kwargs):
    out, grads = _values_and_grads(solve, inputs, **kwargs)
    ref, ref_grads = _values_and_grads(feedback_solve_dense, inputs, scale=kwargs.get("scale"))
    assert out.dtype == torch.float32
    _assert_close(out, ref)
    with torch.no_grad():  # the inference launch (no h / lse saved) computes the very same s
        assert torch.equal(solve(**inputs, **kwargs), out)
    names = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]  # as _leaves
    for name, grad, ref_grad in zip(names, grads, ref_grads):
        _assert_close(grad, ref_grad, msg=lambda m, n=name: f"d{n}: {m}")


@interpreter_only
def test_kernels_are_interpreted():
    for kernel in (fst._fwd_kernel, fst._bwd_lam_kernel, fst._bwd_dq_kernel, fst._bwd_dk_kernel):
        assert isinstance(kernel, InterpretedFunction)


@needs_kernels
# chunk 1 (a chunk a token: 20 s interpreted) with a cache only; 64 >= T: a single chunk
@pytest.mark.parametrize("past, chunk_size", first_in_fast((6, 5), (0, 5), (0, 16), (0, 64), (6, 1), (6, 16), (6, 64)))
def test_matches_dense_values_and_gradients(past, chunk_size):
    _assert_matches_dense(make_inputs(past=past), chunk_size=chunk_size)


@needs_kernels
@pytest.mark.parametrize("length,past", first_in_fast((1, 45), (3, 45), (1, 0)))
def test_decode_and_short_calls(length, past):
    """Decode-like calls (few new rows, a cache spanning several key blocks) and a single token."""
    inputs = make_inputs(batch=2, length=length, past=past, padded=past > 0)
    _assert_matches_dense(inputs, chunk_size=16)


@needs_kernels
@pytest.mark.parametrize("scale", first_in_fast(4.0, 0.37))  # 4.0: logits up to ~50, peaked rows test the online max
def test_no_mask_custom_scale_and_long_sequence(scale):
    inputs = make_inputs(batch=1, length=96, width=32, key_dim=16, padded=False, seed=3, gain_scale=0.998)
    inputs["key_mask"] = None
    _assert_matches_dense(inputs, chunk_size=16, scale=scale)


@needs_kernels
def test_rows_without_keys_pass_f_through_exactly():
    inputs = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs(past=6).items()}
    s = solve(**inputs, chunk_size=16)
    f = inputs["f"]
    assert torch.equal(s[0, :4], f[0, :4])  # sequence 0: tokens 0..3 see only padding
    no_cache = {**inputs, "past_k": None, "past_s": None, "key_mask": None}
    assert torch.equal(solve(**no_cache, chunk_size=16)[:, 0], f[:, 0])  # t = 0


@needs_kernels
def test_zero_gain_returns_f_bitwise():
    inputs = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs(past=6).items()}
    inputs["gain"] = torch.zeros_like(inputs["gain"])
    assert torch.equal(solve(**inputs, chunk_size=16), inputs["f"])


@needs_kernels
def test_padded_keys_are_never_read():
    inputs = {n: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
              for n, v in make_inputs(past=6).items()}
    base = solve(**inputs, chunk_size=16)
    poisoned = dict(inputs)
    for name, rows in (("past_k", slice(0, 6)), ("past_s", slice(0, 6)), ("k", slice(0, 3)), ("f", slice(0, 3))):
        poisoned[name] = inputs[name].clone()
        poisoned[name][0, rows] = 1e6  # sequence 0's padding
    out = solve(**poisoned, chunk_size=16)
    torch.testing.assert_close(out[0, 3:], base[0, 3:], rtol=0, atol=0)
    torch.testing.assert_close(out[1:], base[1:], rtol=0, atol=0)


@needs_kernels
def test_causality():
    inputs = {n: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs().items()}
    base = solve(**inputs, chunk_size=16)
    for name in ("f", "q", "k", "gain"):
        bumped = dict(inputs)
        bumped[name] = inputs[name].clone()
        bumped[name][:, 10] += 1.0  # inside the first chunk: rows 0..9 of that chunk must not move
        assert torch.equal(solve(**bumped, chunk_size=16)[:, :10], base[:, :10]), name


@needs_kernels
@pytest.mark.parametrize("dtype", first_in_fast(torch.bfloat16, torch.float16))
def test_half_inputs_accumulate_in_fp32(dtype):
    inputs = make_inputs(past=6, dtype=dtype)
    out, grads = _values_and_grads(solve, inputs, chunk_size=16)
    assert out.dtype == torch.float32
    assert [g.dtype for g in grads] == [dtype] * len(grads)  # gradients come back in each input's dtype
    upcast = {n: (v.detach().float().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v) for n, v in inputs.items()}
    ref, ref_grads = _values_and_grads(feedback_solve_dense, upcast)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # same rounded inputs, fp32 math on both sides
    for grad, ref_grad in zip(grads, ref_grads):  # only the final cast to the input dtype differs
        torch.testing.assert_close(grad.float(), ref_grad, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_partial_gradients_detached_cache_and_non_contiguous_inputs():
    inputs = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in make_inputs(past=6).items()}
    q_t = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not q_t.is_contiguous()
    grads = {}
    for fn, q in ((solve, q_t), (feedback_solve_dense, inputs["q"])):  # only q and k need gradients
        q, k = q.clone().requires_grad_(), inputs["k"].clone().requires_grad_()
        kwargs = {"chunk_size": 16} if fn is solve else {}
        out = fn(inputs["f"], q, k, inputs["gain"], key_mask=inputs["key_mask"], past_k=inputs["past_k"],
                 past_s=inputs["past_s"], **kwargs)
        grads[fn] = (out, *torch.autograd.grad(out.square().sum(), (q, k)))
    for actual, expected in zip(grads[solve], grads[feedback_solve_dense]):
        _assert_close(actual, expected)


@needs_kernels
@pytest.mark.parametrize("past, detached_cache, need_q", first_in_fast((6, False, True), (0, False, False),
                                                                      (6, True, True)))
def test_warmups_are_exactly_what_the_call_launches(past, detached_cache, need_q, monkeypatch):
    """``_warmups`` (compiled side by side before a training call's first launch on CUDA,
    kernels/triton_compile.py) names every kernel variant the call then launches -- the forward, the lam sweep, dq
    and dk as wanted -- with the same argument kinds and constexprs: none missing, none extra."""
    launched = record_launches(monkeypatch, (fst._fwd_kernel, fst._bwd_lam_kernel, fst._bwd_dq_kernel,
                                             fst._bwd_dk_kernel))
    launched.run, warmed = False, set()  # what is launched, not its values
    monkeypatch.setattr(fst, "_compile_kernels", lambda *args: warmed.update(
        compile_key(kernel, launch_args, constexprs) for kernel, _, launch_args, constexprs in fst._warmups(*args)))
    inputs = make_inputs(past=past, dtype=torch.bfloat16)
    if detached_cache and past:
        inputs["past_k"], inputs["past_s"] = inputs["past_k"].detach(), inputs["past_s"].detach()
    if not need_q:
        inputs["q"] = inputs["q"].detach()
    out = solve(**inputs, chunk_size=16)
    torch.autograd.grad(out.square().sum(), _leaves(inputs))
    assert launched and warmed == launched
    assert {key[0] for key in launched} == {"_fwd_kernel", "_bwd_lam_kernel", "_bwd_dk_kernel"} | (
        {"_bwd_dq_kernel"} if need_q else set())


@needs_kernels
def test_the_sweeps_are_pipelines_of_a_program_a_chunk(monkeypatch):
    """The forward and the lam sweep launch one program per (batch row, column block, chunk), so no program walks
    the sequence's chunks (the sweep had one per batch row and column block); 5 chunks of 8 here."""
    grids = {}
    launch = fst._launch
    monkeypatch.setattr(fst, "_launch", lambda launches: (
        grids.update({kernel.fn.__name__: grid for kernel, grid, _, _ in launches}), launch(launches))[1])
    inputs = make_inputs()
    out = solve(**inputs, chunk_size=8)
    torch.autograd.grad(out.square().sum(), _leaves(inputs))
    assert grids["_fwd_kernel"] == grids["_bwd_lam_kernel"] == (B * 1 * 5,)


@needs_kernels
def test_the_entry_point_sends_fp64_to_pytorch_and_bad_arguments_are_named():
    """feedback_solve holds every choice: fp64 takes the PyTorch path under "auto", is an error when the kernel is
    forced, and the kernel itself refuses it by name."""
    from hf_mixers.kernels.feedback_solve import feedback_solve

    inputs = make_inputs(batch=1, length=5, width=3, key_dim=2, past=2, dtype=torch.float64)
    out = feedback_solve(**inputs, chunk_size=2)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, feedback_solve_dense(**inputs), rtol=0, atol=1e-10)
    with pytest.raises(RuntimeError, match="requested .* but cannot run: torch.float64 inputs"):
        feedback_solve(**inputs, backend="triton")
    with pytest.raises(ValueError, match="the kernels compute in fp32"):
        solve(**inputs)
    inputs = make_inputs(batch=1, length=5, width=3, key_dim=2, past=2)
    torch.testing.assert_close(feedback_solve(**inputs, chunk_size=2, backend="triton"),
                               solve(**inputs, chunk_size=2), rtol=0, atol=0)  # fp32: the kernel itself
    with pytest.raises(ValueError, match="key_mask has shape"):
        solve(**{**inputs, "key_mask": inputs["key_mask"][:, 2:]})
    with pytest.raises(ValueError, match="chunk_size"):
        solve(**inputs, chunk_size=0)


@needs_kernels
@pytest.mark.parametrize("past, detached_cache", first_in_fast((6, False), (0, False), (45, True)))
def test_value_columns_in_blocks_match_dense(past, detached_cache, monkeypatch):
    """The value columns are taken VALUE_FEATURE_BLOCK at a time (so SmolLM2's one feedback row of 576 and an 8B
    model's of 4096 take the kernels): cut to 8, a row of 20 takes three blocks, the last ragged. The forward and
    the lam sweep run a block of columns per program, d_gain sums over them, dq and dk sum lam_t . s_j over them, the
    cached values' gradient is written block by block: values and every gradient equal the dense solve."""
    monkeypatch.setattr(fst, "VALUE_FEATURE_BLOCK", 8)
    assert fst._meta(T, KD, D, 16)["block_dv"] == 8 < D
    inputs = make_inputs(past=past, padded=True)
    if detached_cache and past:
        inputs["past_k"], inputs["past_s"] = inputs["past_k"].detach(), inputs["past_s"].detach()
    _assert_matches_dense(inputs, chunk_size=16)


@needs_kernels
@pytest.mark.parametrize("past, detached_cache", first_in_fast((6, False), (0, False), (45, True)))
def test_keys_in_blocks_match_dense(past, detached_cache, monkeypatch):
    """The key features are taken KEY_FEATURE_BLOCK at a time (so the official conversion's one feedback head, 576
    wide for SmolLM2 and 4096 for an 8B model, takes the kernels): cut to 8, keys 12 wide take two blocks, the
    second ragged. The logits sum over them everywhere; dq and dk run one block of their columns per program; values
    and every gradient equal the dense solve, with the value columns in blocks too."""
    monkeypatch.setattr(fst, "KEY_FEATURE_BLOCK", 8)
    monkeypatch.setattr(fst, "GRADIENT_KEY_BLOCK", 8)  # dq / dk's own key blocks (16 by default: one block at KD)
    monkeypatch.setattr(fst, "VALUE_FEATURE_BLOCK", 8)
    meta = fst._meta(T, KD, D, 16)
    assert meta["block_dk"] == 8 < KD and meta["block_dv"] == 8 < D
    assert meta["block_dk_grad"] == 8 < KD
    inputs = make_inputs(past=past, padded=True)
    if detached_cache and past:
        inputs["past_k"], inputs["past_s"] = inputs["past_k"].detach(), inputs["past_s"].detach()
    _assert_matches_dense(inputs, chunk_size=16)


@needs_kernels
def test_sessa_model_on_the_triton_path_equals_the_pytorch_path():
    """The dispatch end to end: a tiny Sessa model with kernel_backend="triton" gives the logits, gradients and
    cached decoding of the same model on the PyTorch path (left-padded batch, chunks of 16)."""
    from conftest import step_through, tiny_sessa_model

    models = {backend: tiny_sessa_model(kernel_backend=backend, sessa_chunk_size=16).to(DEVICE)
              for backend in ("torch", "triton")}
    ids = torch.randint(1, 101, (2, 29), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    results = {}
    for backend, model in models.items():
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        (logits[mask.bool()].float().pow(2).mean()).backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
    _assert_close(results["triton"][0], results["torch"][0])
    assert results["triton"][1].keys() == results["torch"][1].keys()
    for name, grad in results["torch"][1].items():
        _assert_close(results["triton"][1][name], grad, msg=name)
    decoded, _ = step_through(models["triton"], ids, mask, prefill=20)  # prefill + 9 single-token steps
    _assert_close(decoded[mask.bool()], results["triton"][0][mask.bool()])


@needs_kernels
@pytest.mark.parametrize("past", first_in_fast(6, 0))
def test_the_solve_is_one_opaque_op_for_torch_compile(past):
    """The kernels are torch.library ops (forward and backward): torch.compile keeps each as one call in a single
    graph and never traces a launch; the compiled solve, its gradients and its inference call equal the eager ones."""
    inputs = make_inputs(past=past)
    expected, expected_grads = _values_and_grads(solve, inputs, chunk_size=5)
    torch._dynamo.reset()
    compiled = torch.compile(solve, fullgraph=True, backend="aot_eager_decomp_partition")
    actual, grads = _values_and_grads(compiled, inputs, chunk_size=5)
    assert torch.equal(actual, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)
    with torch.no_grad():
        assert torch.equal(compiled(**inputs, chunk_size=5), expected)
    torch._dynamo.reset()


@needs_kernels
def test_half_inputs_take_tf32_dots_within_the_bf16_bound(monkeypatch):
    """bf16 / fp16 operands take plain tf32 dots, fp32 operands fp32-accurate ones (``dot_precision``). Issue 67's
    criterion on the kernels themselves, every dot of theirs rounded as a tensor core rounds it (``tf32_dots``: the
    interpreter otherwise computes in fp32): the output and every gradient of a bf16 call, its fp32 results before
    the cast, stay within the bf16 bound -- the error the exact (fp64) solve makes from its inputs rounded to bf16.
    Two chunks of 32 and more, two value-column and two key-feature blocks, left padding."""
    assert (dot_precision(torch.bfloat16), dot_precision(torch.float16), dot_precision(torch.float32)) == (
        "tf32", "tf32", "tf32x3")
    tf32_dots(monkeypatch)
    inputs = make_inputs(batch=2, length=80, width=64, key_dim=48, gain_scale=0.95)
    names = ("f", "q", "k", "gain")

    def exact(values):  # the dense solve in fp64: output and gradients under a fixed probe
        leaves = {n: values[n].detach().double().requires_grad_() for n in names}
        out = feedback_solve_dense(**leaves, key_mask=inputs["key_mask"])
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return [out.detach(), *torch.autograd.grad((out * probe.to(out.device)).sum(), list(leaves.values()))]

    rounded = {n: inputs[n].detach().to(torch.bfloat16) for n in names}
    reference = exact(rounded)
    bound = [relative_error(a, b) for a, b in zip(reference, exact(inputs))]
    operands = fst._prepared(*(rounded[n] for n in names), inputs["key_mask"], None, None)
    scale = 48 ** -0.5
    s, h, lse = fst._solve_forward(*operands, scale, 64, True, True, True, False)
    probe = torch.randn(s.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(s.device)
    f_grad, q_grad, k_grad, gain_grad, *_ = fst._solve_backward(*operands[1:], s, h, lse, probe.float(), scale, 64,
                                                                True, True, False)
    errors = [relative_error(a, b) for a, b in zip((s, f_grad, q_grad, k_grad, gain_grad), reference)]
    for name, error, limit in zip(("s", *(f"d{n}" for n in names)), errors, bound):
        assert 0 < error <= limit, f"{name}: tf32 error {error:.3g} over the bf16 bound {limit:.3g}"
