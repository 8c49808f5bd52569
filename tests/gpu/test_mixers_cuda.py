"""Every registered mixer on the GPU equals the same model on the CPU's PyTorch reference path: forward, backward,
cached decoding and ``generate``, in fp32 (bf16 close to fp32); bf16 / fp16 training under autocast; the dispatch
picks each fast path with its one log line; the compiled decode step (torch.compile, and with CUDA graphs) equals
the eager one; a conversion on the device equals the CPU's. The maintained libraries' kernels:
test_libraries_cuda.py.

The reference model sits on the CPU with ``kernel_backend="torch"``; the model under test is its copy on DEVICE with
the default "auto" (Triton kernels on CUDA; under the dry run the interpreter on CPU tensors).
"""

import logging

import pytest
import torch
from conftest import step_through
from gpu_setup import DEVICE, DRY, ON_DEVICE, record, relative_error  # noqa: F401 (record: a fixture)

from hf_mixers.core.registry import list_mixers
from hf_mixers.kernels import dispatch
from hf_mixers.testing import HYBRID, _inputs, check_mixed_precision, tiny_model

pytestmark = ON_DEVICE
# On the GPU every mixer alone and the hybrid (all of them in one model); in the dry run, which proves only that
# these tests still run (the contract suite checks each mixer on CPU), the hybrid alone.
NAMES = [spec.name for spec in list_mixers()] + [HYBRID] if not DRY else [HYBRID]
FP32_BOUND = 2e-3  # TF32-class dots in the kernels against the CPU's fp32


def _pair(name, **overrides):
    """(reference on the CPU, forced onto the PyTorch path; the same weights on DEVICE, auto dispatch)."""
    reference = tiny_model(name, dtype=torch.float32, kernel_backend="torch", **overrides)
    model = tiny_model(name, dtype=torch.float32, **overrides)
    model.load_state_dict(reference.state_dict())
    return reference, model.to(DEVICE)


def _forward_backward(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False).logits
    logits.float().pow(2).mean().backward()
    grads = torch.cat([p.grad.detach().double().cpu().flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach(), grads


def _step_through(model, ids, mask, prefill):
    """Prefill, then one token at a time through one cache: the logits of every position."""
    return step_through(model, ids, mask, prefill)[0]


@pytest.mark.parametrize("name", NAMES)
def test_model_on_device_equals_the_cpu_reference(name, record):
    reference, model = _pair(name)
    ids, mask = _inputs()
    valid = mask.bool()
    expected_logits, expected_grads = _forward_backward(reference, ids, mask)
    logits, grads = _forward_backward(model, ids, mask)
    decoded = _step_through(model.eval(), ids, mask, prefill=5)
    errors = {"logits": relative_error(logits.cpu()[valid], expected_logits[valid]),
              "gradients": relative_error(grads, expected_grads),
              "prefill+decode": relative_error(decoded.cpu()[valid], expected_logits[valid])}
    with torch.no_grad():
        low = model.to(torch.bfloat16)(ids.to(DEVICE), attention_mask=mask.to(DEVICE)).logits.float().cpu()
    errors["bf16 logits"] = relative_error(low[valid], expected_logits[valid])
    record(mixer=name, errors=errors)
    bad = {k: v for k, v in errors.items() if not v < (5e-2 if k.startswith("bf16") else FP32_BOUND)}
    assert not bad, f"{name} on {DEVICE}: relative errors against the CPU reference over the bound: {bad}"


@pytest.mark.parametrize("name", NAMES)
def test_generate_on_device_equals_the_cpu_reference(name):
    reference, model = _pair(name)
    ids, mask = _inputs(length=6, pad=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=8 if not DRY else 3, do_sample=False, pad_token_id=0)
    expected = reference.generate(ids, **kwargs)
    produced = model.generate(ids.to(DEVICE), **{**kwargs, "attention_mask": mask.to(DEVICE)}).cpu()
    uncached = model.generate(ids.to(DEVICE), use_cache=False,
                              **{**kwargs, "attention_mask": mask.to(DEVICE)}).cpu()
    assert torch.equal(produced, uncached), f"{name} on {DEVICE}: cached and uncached greedy tokens differ"
    assert torch.equal(produced, expected), f"{name}: greedy tokens on {DEVICE} differ from the CPU's"


def test_dispatch_picks_each_fast_path_with_one_log_line(caplog, record):
    """On the device the Sessa solve and RSA's chunk read (options its kernel covers) take their Triton kernels and
    say so once; every other mixer's decisions are recorded with their reasons (a library not installed, an option a
    kernel does not cover)."""
    ids, mask = _inputs(length=24 if not DRY else 12)
    runs = [("sessa", {}), ("rsa", {"rsa_decay": False, "rsa_window": 0})] + [(name, {}) for name in NAMES]
    lines = []
    for index, (name, options) in enumerate(runs):
        dispatch._announced.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
            model = _pair(name, **options)[1]
            for _ in range(2):  # twice: still one line per decision
                with torch.no_grad():
                    model(ids.to(DEVICE), attention_mask=mask.to(DEVICE))
        said = [r.getMessage() for r in caplog.records if r.name == "hf_mixers.kernels"]
        assert len(said) == len(set(said)), f"{name}: a decision was logged more than once: {said}"
        lines += [f"{name}{options or ''}: {line}" for line in said]
        if index < 2:
            kernel = {"sessa": "Sessa feedback solve", "rsa": "RSA chunk step"}[name]
            assert f"hf_mixers: {kernel} runs on the Triton kernel" in said, f"{name}: {said}"
    record(decisions=lines)


COMPILED_STEPS = {"rsa": dict(layer_types=["rsa", "rsa"], rsa_query_read=True, rsa_decay=True, rsa_window=4),
                  "sessa": dict(sessa_gamma_bias_init=0.4)}  # Sessa: symbolic shapes, its growing cache in place


@pytest.mark.parametrize("name", sorted(COMPILED_STEPS) if not DRY else ["rsa"])  # the dry run: that it runs
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "reduce-overhead, states in place"])
def test_compiled_decode_equals_eager(mode, name, monkeypatch, record):
    """compile_decode: the torch.compile'd step equals the eager step on the device; "reduce-overhead" replays it as
    a CUDA graph (RSA's two layers as one graph for the stack; Sessa's step, of growing shapes, runs compiled without
    one, block by block); "states in place": the stack writes its states into the cache's tensors at static
    addresses (decode/engine.py ``IN_PLACE_DEVICES``, off by default)."""
    if mode != "default" and DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    from hf_mixers.decode import engine

    torch._dynamo.reset()
    monkeypatch.setattr(engine, "_compiled_steps", {})
    if mode.endswith("in place"):
        monkeypatch.setattr(engine, "IN_PLACE_DEVICES", ("cuda",))
        monkeypatch.setattr(engine, "_fixed_points", set())
    options = COMPILED_STEPS[name]
    _, eager = _pair(name, **options)
    compiled = tiny_model(name, dtype=torch.float32, compile_decode=mode.split(",")[0], **options).to(DEVICE)
    compiled.load_state_dict(eager.state_dict())
    ids, mask = _inputs(length=14)
    expected = _step_through(eager, ids, mask, prefill=5)
    stepped = _step_through(compiled, ids, mask, prefill=5)
    valid = mask.bool().to(DEVICE)
    error = relative_error(stepped[valid], expected[valid])
    record(mode=f"{name} {mode}", error=error)
    assert error < 1e-5, f"{name}: compiled ({mode}) decode vs eager: relative error {error:.2e}"


@pytest.mark.parametrize("mixer", [spec.name for spec in list_mixers(convertible=True)] if not DRY else ["sessa"])
def test_conversion_on_the_device_equals_the_cpu_conversion(mixer, tmp_path, record):
    """A teacher on the device converts there (calibration forward, k-means, the at-init report) to the student the
    CPU conversion builds: the same layer errors and held-out KL within the device's float error."""
    from conftest import save_tiny_teacher
    from hf_mixers.conversion import convert, load_teacher

    save_tiny_teacher(str(tmp_path))
    options = dict(sequence_length=32, calibration_sequences=2, heldout_sequences=1, progress=False)
    _, on_cpu = convert(load_teacher(str(tmp_path)), mixer, **options)
    teacher = load_teacher(str(tmp_path))
    teacher.model.to(DEVICE)
    student, on_device = convert(teacher, mixer, share_teacher_weights=True, **options)
    assert next(student.parameters()).device.type == DEVICE.type
    for cpu_layer, device_layer in zip(on_cpu.layers, on_device.layers):
        if cpu_layer.error is not None:
            assert device_layer.error == pytest.approx(cpu_layer.error, rel=5e-2, abs=1e-3), (mixer, cpu_layer.index)
    assert on_device.kl_teacher_student == pytest.approx(on_cpu.kl_teacher_student, rel=5e-2, abs=1e-4)
    record(test="conversion", mixer=mixer, kl_cpu=on_cpu.kl_teacher_student, kl_device=on_device.kl_teacher_student)


def test_adamw_is_fused_on_the_device_and_steps_like_the_cpus():
    """train.optimizer=adamw takes torch's fused kernel for tensors on CUDA (the foreach one on the CPU, and under the
    dry run), and one step moves the weights as the CPU's does."""
    from hf_mixers.recipes.config import TrainSection
    from hf_mixers.recipes.optimizers import make_optimizer

    torch.manual_seed(0)
    start, grad = torch.randn(64, 32), torch.randn(64, 32)
    stepped = {}
    for device in ("cpu", str(DEVICE)):
        weight = torch.nn.Parameter(start.to(device))
        optimizer = make_optimizer([weight], TrainSection(weight_decay=0.01), 1e-2)
        assert bool(optimizer.defaults.get("fused")) == (torch.device(device).type == "cuda")
        weight.grad = grad.to(device)
        optimizer.step()
        stepped[device] = weight.detach().cpu()
    torch.testing.assert_close(stepped[str(DEVICE)], stepped["cpu"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_precision_training_on_device(name):
    """train.precision bf16 and fp16 on the device: teacher weights in that dtype, the mixer's own tensors fp32, CUDA
    autocast around the Triton kernels (which compute outside it, in fp32): close to fp32, finite fp32 gradients.
    Last in the file: the step's time limit reaches the other tests first."""
    check_mixed_precision(name, device=DEVICE)
