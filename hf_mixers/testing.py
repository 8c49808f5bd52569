"""The mixer contract: the properties every registered mixer must have, as plain functions (pytest not required).

``check_mixer(name)`` runs them all on a registered mixer and raises ``AssertionError`` naming the property that
failed; tests/contract/test_mixer_contract.py runs each one over every registered mixer and a hybrid. A new mixer
gets all of them by registering. Models are tiny (hidden 32, 2 layers, T <= 12) and equivalences are checked in fp64
on CPU.
"""

from __future__ import annotations

import os
import tempfile

import torch

from .core.registry import get_mixer, list_mixers
from .core.window import WindowState
from .decode.switch import has_token_step
from .model.config import config_class

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            sliding_window=4)
HYBRID = "hybrid"  # every convertible mixer, plus full and sliding attention, in one model
TOLERANCE = {torch.float64: dict(rtol=1e-7, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def contract_names() -> list[str]:
    """What the contract suite checks: every registered mixer, each of its ``tiny_variants`` as ``"name[variant]"``,
    and the hybrid."""
    names = []
    for spec in list_mixers():
        names += [spec.name, *(f"{spec.name}[{variant}]" for variant in spec.tiny_variants)]
    return names + [HYBRID]


def _variant(name: str) -> tuple[str, dict]:
    """``"rsa[window]"`` -> ("rsa", the spec's window options); a plain name -> (name, {})."""
    if not name.endswith("]"):
        return name, {}
    mixer, variant = name[:-1].split("[", 1)
    variants = get_mixer(mixer).tiny_variants
    if variant not in variants:
        raise KeyError(f"mixer {mixer!r} has no contract variant {variant!r} (it has {sorted(variants)})")
    return mixer, variants[variant]


def _layer_types(name: str) -> list[str]:
    name = _variant(name)[0]
    if name == HYBRID:
        return [spec.name for spec in list_mixers(convertible=True)] + ["full_attention", "sliding_attention"]
    return [name, name]


def tiny_config(name: str, **overrides):
    """A tiny config of mixer ``name`` (or ``HYBRID``) with every spec's ``tiny_options``."""
    layer_types = _layer_types(name)
    name, variant = _variant(name)
    options = {}
    for kind in set(layer_types):
        options.update(get_mixer(kind).tiny_options)
    options.update(variant)
    cls = config_class(name) if name != HYBRID else config_class("full_attention")
    config = cls(**{**TINY, "num_hidden_layers": len(layer_types), "layer_types": layer_types, **options,
                    **overrides})
    config._attn_implementation = "sdpa"
    return config


def tiny_model(name: str, dtype=torch.float64, seed: int = 0, **overrides):
    from .model.modeling import MixerForCausalLM

    torch.manual_seed(seed)
    return MixerForCausalLM(tiny_config(name, **overrides)).to(dtype).eval()


def _inputs(batch=2, length=12, seed=1, pad=3):
    """Token ids (B, T) and a mask whose last row is left-padded by ``pad`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = TINY["pad_token_id"]
    return ids, mask


def _close(actual, expected, what, dtype=torch.float64):
    try:
        torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def _logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def check_config(name):
    """The config round-trips through to_dict / from_dict, carries the options of its own mixers only, and every
    option's check rejects a wrong value by name."""
    config = tiny_config(name)
    saved = config.to_dict()
    again = type(config).from_dict(saved)
    assert again.layer_types == config.layer_types, "config round trip: layer_types changed"
    assert "layer_types" not in saved, "config: the saved dict must name layers in mixer_types"
    foreign = sorted(option.name for spec in list_mixers() if spec.name not in set(config.layer_types)
                     for option in spec.options if option.name in saved)
    assert not foreign, f"config: carries options of mixers its layers do not use: {foreign}"
    for kind in set(config.layer_types):
        for option in get_mixer(kind).options:
            assert getattr(again, option.name) == getattr(config, option.name), f"config round trip: {option.name}"
            if option.check is None:
                continue
            try:
                tiny_config(name, **{option.name: "not a valid value"})
            except ValueError as error:
                assert option.name in str(error), f"config: the error for a bad {option.name} does not name it"
            else:
                raise AssertionError(f"config: {option.name}='not a valid value' was accepted")


def check_forward_backward(name):
    """Forward shapes and dtype, no NaN, and a non-zero gradient reaches every parameter (after moving every
    parameter off its init: zero-initialised output weights would hide what feeds them)."""
    model = tiny_model(name, dtype=torch.float32).train()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    ids, mask = _inputs()
    logits = model(ids, attention_mask=mask).logits
    assert logits.shape == (*ids.shape, TINY["vocab_size"]) and logits.dtype == torch.float32, "forward: shape/dtype"
    assert torch.isfinite(logits).all(), "forward: non-finite logits"
    logits[mask.bool()].float().pow(2).mean().backward()
    silent = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    silent = [n for n in silent if not n.endswith("embed_tokens.weight")]
    assert not silent, f"backward: no gradient reaches {silent}"


def check_block_compiles_whole(name):
    """A block's training step (forward + backward, padded batch) is one graph for torch.compile: it compiles with
    ``fullgraph=True`` (a graph break is an error naming it, as ``torch._dynamo.explain`` would list it), and the
    graph, traced by AOTAutograd with Inductor's decompositions, gives the eager output and input gradient. On a GPU
    the step can then be captured (CUDA graphs) instead of launched op by op. One block per layer type."""
    model = tiny_model(name, dtype=torch.float32).train()
    ids, mask = _inputs()
    first = {kind: index for index, kind in reversed(list(enumerate(model.config.layer_types)))}
    calls = {}

    def keep_call(block, args, kwargs):
        calls[block] = (args, kwargs)

    blocks = [model.model.layers[index] for index in sorted(first.values())]
    handles = [block.register_forward_pre_hook(keep_call, with_kwargs=True) for block in blocks]
    model(ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    for block in blocks:
        args, kwargs = calls[block]
        hidden = args[0].detach().requires_grad_()
        where = f"block {block.mixer.layer_idx} ({model.config.layer_types[block.mixer.layer_idx]})"

        def step(x, block=block, rest=args[1:], kwargs=kwargs):
            return block(x, *rest, **kwargs)

        check_step_compiles_whole(step, hidden, where)


def check_step_compiles_whole(step, x, where: str = "the step", reference=None) -> None:
    """``step(x)`` (x asks for gradients) compiles with ``fullgraph=True`` (a graph break is an error naming it) and,
    traced by AOTAutograd with Inductor's decompositions, gives the eager output and input gradient: ``step``'s own,
    or ``reference``'s (the same layer on another path, e.g. PyTorch's where ``step`` runs interpreted kernels)."""
    expected = (reference or step)(x)
    weights = torch.randn_like(expected)
    expected_grad, = torch.autograd.grad((expected * weights).sum(), x)
    torch._dynamo.reset()
    try:
        try:
            actual = torch.compile(step, fullgraph=True, backend="aot_eager_decomp_partition")(x)
        except Exception as error:  # dynamo's message names the break and the line
            raise AssertionError(f"compile: {where} is not one graph: {str(error).splitlines()[0]}") from error
        actual_grad, = torch.autograd.grad((actual * weights).sum(), x)
    finally:
        torch._dynamo.reset()
    _close(actual, expected, f"compile: {where}'s compiled forward", torch.float32)
    _close(actual_grad, expected_grad, f"compile: {where}'s compiled backward", torch.float32)


def check_gradcheck(name):
    """fp64 gradcheck of one mixer layer with respect to its input."""
    from .model.modeling import MixerModel

    model = MixerModel(tiny_config(name)).double()
    mixer, length = model.layers[0].mixer, 5
    x = torch.randn(1, length, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    positions = model.rotary_emb(x, torch.arange(length)[None])
    assert torch.autograd.gradcheck(lambda h: mixer(h, positions), (x,), eps=1e-6, atol=1e-5), "gradcheck"


def check_decode_equals_forward(name):
    """Prefill + token-by-token decode of a left-padded batch equals one full forward."""
    model = tiny_model(name)
    ids, mask = _inputs()
    valid = mask.bool()
    _close(_decode(model, ids, mask)[valid], _logits(model, ids, mask)[valid], "prefill + decode vs one forward")


def _decode(model, ids, mask, prefill=5, after_step=None):
    """Logits of a prefill of ``prefill`` tokens then one token at a time (``after_step(index, cache)`` is called
    after each single-token step, from 0). ``mask`` None: no attention mask, as ``generate`` steps a batch without
    padding (transformers drops a mask of all ones)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)

    def upto(end):  # the mask of the first ``end`` tokens
        return None if mask is None else mask[:, :end]

    steps = [_logits(model, ids[:, :prefill], upto(prefill), past_key_values=cache, use_cache=True)]
    for t in range(prefill, ids.shape[1]):
        steps.append(_logits(model, ids[:, t:t + 1], upto(t + 1), past_key_values=cache, use_cache=True))
        if after_step is not None:
            after_step(t - prefill, cache)
    return torch.cat(steps, 1)


def reset_compiled_steps() -> None:
    """Forget every compiled token step of this process: dynamo's graphs and counters, the exported steps' loaded
    libraries and counts (decode/exported.py; the libraries on disk stay)."""
    from .decode import exported as exported_step

    torch._dynamo.reset()
    exported_step.reset()
    torch._dynamo.utils.counters.clear()


def graphs_built() -> int:
    """Token-step graphs built since ``reset_compiled_steps``: torch.compile's and the exported steps' (each export
    is one program, whether its library was compiled or found on disk)."""
    from .decode import exported as exported_step

    return torch._dynamo.utils.counters["stats"]["unique_graphs"] + exported_step.counts["exported"]


def check_compiled_decode(name):
    """``config.compile_decode``: each one-token step of a block around a mixer that has a compiled step (the
    recurrent mixers, GLTM, Sessa) runs as one compiled graph (torch.compile's, or on CPU for a step of fixed shapes
    in fp32 / fp64 an exported AOTInductor library: decode/exported.py), equal to the eager step and to one full
    forward, on a left-padded batch; one graph per such mixer class, built at the first step and never rebuilt for
    the later ones, nor for steps without an attention mask (``generate``'s on a batch without padding); the teacher's
    q/k/v_proj, where the mixer keeps them, as one product (``fuse_qkv``); a local window's ring buffers written in
    place (the same memory from step to step, core/window.py). Equal to fp32 precision, not fp64's: the
    Llama RMSNorm computes in fp32 whatever the model's dtype, and the compiled graph sums in another order."""
    eager = tiny_model(name)
    compiled = tiny_model(name, compile_decode=True)
    ids, mask = _inputs()
    valid = mask.bool()
    full, reference = _logits(eager, ids, mask), _decode(eager, ids, mask)
    counters = torch._dynamo.utils.counters
    reset_compiled_steps()  # a fresh count (and the recompile limit not spent by earlier models in this process)
    graphs, rings = {}, {}

    def after_step(index, cache):
        if index == 0:
            graphs["first"] = graphs_built()
        for layer, layer_cache in enumerate(cache.layers):  # where each window's ring buffers lie
            state = getattr(layer_cache, "state", None)
            if isinstance(state, WindowState):
                rings.setdefault(layer, set()).add(tuple(t.data_ptr() for t in (state.keys, state.values,
                                                                                 state.valid, *state.extras)))

    stepped = _decode(compiled, ids, mask, after_step=after_step)
    stepping = {type(block.mixer) for block in compiled.model.layers if has_token_step(block.mixer)}
    moved = [layer for layer, places in rings.items() if len(places) > 1]
    assert not moved, f"compiled decode: layers {moved} wrote their window's ring buffers into new memory (a copy " \
        f"of the window a token, where the step writes the new token into its slot in place)"
    assert graphs_built() == graphs["first"] == len(stepping), (
        f"compiled decode: {graphs_built()} graphs ({graphs['first']} after the first step) for {len(stepping)} "
        f"mixer class(es) with a compiled step: a later step recompiled, or a step did not compile (or an exported "
        f"step fell back to torch.compile)")
    assert not counters["graph_break"], f"compiled decode: graph breaks {dict(counters['graph_break'])}"
    unmasked = _decode(compiled, ids, None)  # generate's steps without padding: no mask, the same graph
    assert graphs_built() == len(stepping), (
        f"compiled decode: steps without an attention mask built a graph of their own "
        f"({graphs_built()} graphs for {len(stepping)} mixer class(es))")
    unfused = [index for index, block in enumerate(compiled.model.layers) if has_token_step(block.mixer)
               and getattr(block.mixer, "fuses_qkv", lambda: False)() and not block.mixer.qkv_fused()]
    assert not unfused, f"compiled decode: layers {unfused} ran q/k/v_proj as three products, not one (fuse_qkv)"
    _close(stepped[valid], reference[valid], "compiled decode vs the eager decode", torch.float32)
    _close(stepped[valid], full[valid], "compiled decode vs one forward", torch.float32)
    _close(unmasked, _logits(eager, ids, None), "compiled decode without a mask vs one forward", torch.float32)


def check_chunked_prefill(name):
    """A prefill in two chunks (the second onto a non-empty cache) equals one full forward; after each, a layer's
    recurrent state owns its tensors (a view keeps its whole base alive in the cache: the sums at every chunk
    boundary, say, N + 1 times the state)."""
    from transformers import DynamicCache

    from .core.cache import tensors_of

    model = tiny_model(name)
    ids, mask = _inputs()
    full = _logits(model, ids, mask)
    cache = DynamicCache(config=model.config)

    def prefill(part, part_mask):
        logits = _logits(model, part, part_mask, past_key_values=cache, use_cache=True)
        for index, layer in enumerate(cache.layers):
            for tensor in tensors_of(getattr(layer, "state", None)):
                held = tensor.untyped_storage().nbytes()
                assert held == tensor.numel() * tensor.element_size(), \
                    f"{name}: layer {index}'s state holds a {tuple(tensor.shape)} view of {held} bytes"
        return logits

    first, second = prefill(ids[:, :7], mask[:, :7]), prefill(ids[:, 7:], mask)
    valid = mask.bool()
    _close(torch.cat([first, second], 1)[valid], full[valid], "two-chunk prefill vs one forward")


def check_padding(name):
    """Each row of a left-padded batch equals that sequence run alone."""
    model = tiny_model(name)
    ids, mask = _inputs()
    batch = _logits(model, ids, mask)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        alone = _logits(model, ids[row:row + 1, real], mask[row:row + 1, real])
        _close(batch[row, real], alone[0], f"left-padded row {row} vs the sequence alone")


def check_generate(name):
    """generate() with the cache equals generate() without it: greedy, seeded sampling and beam search."""
    model = tiny_model(name)
    ids, mask = _inputs(length=6, pad=2)
    for mode, kwargs in (("greedy", dict(do_sample=False)), ("sampling", dict(do_sample=True, top_k=0)),
                         ("beam search", dict(do_sample=False, num_beams=2))):
        outputs = []
        for use_cache in (True, False):
            torch.manual_seed(0)
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=5, use_cache=use_cache,
                                          pad_token_id=0, **kwargs))
        assert torch.equal(*outputs), f"generate ({mode}): cached and uncached tokens differ"


def check_remote_code(name):
    """Saved, the folder loads through remote code in a fresh process without hf_mixers and gives the same logits."""
    failure = remote_code_failures([name])[name]
    if failure:
        raise AssertionError(failure)


def remote_code_failures(names) -> dict:
    """``check_remote_code`` for several mixers with one fresh process (torch and transformers start once):
    {name: None when its folder loads and gives the same logits, else what failed}."""
    from .common.remote_check import load_many_in_fresh_process

    ids, mask = _inputs()
    models = {name: tiny_model(name, dtype=torch.float32) for name in names}
    with tempfile.TemporaryDirectory() as folder:
        jobs = []
        for index, (name, model) in enumerate(models.items()):
            path = os.path.join(folder, f"model-{index}")  # distinct names: remote code is cached by folder name
            model.save_pretrained(path)
            jobs.append(dict(model_dir=path, input_ids=ids, attention_mask=mask, max_new_tokens=3))
        results = load_many_in_fresh_process(jobs)
    failures = {}
    for (name, model), remote in zip(models.items(), results):
        failures[name] = None
        try:
            assert "error" not in remote, f"remote code: the folder does not load:\n{remote.get('error', '')[-3000:]}"
            assert not remote["hf_mixers_imported"], "remote code: the child process imported hf_mixers"
            _close(remote["logits"], _logits(model, ids, mask), "remote-code logits vs the model's", torch.float32)
        except AssertionError as error:
            failures[name] = f"{name}: {error}"
    return failures


def check_bf16(name):
    """A bf16 forward stays close to fp32 (relative RMS error below 5%)."""
    model = tiny_model(name, dtype=torch.float32)
    ids, mask = _inputs()
    reference = _logits(model, ids, mask)
    low = _logits(model.to(torch.bfloat16), ids, mask).float()
    valid = mask.bool()
    error = ((low - reference)[valid].pow(2).mean() / reference[valid].pow(2).mean()).sqrt().item()
    assert error < 0.05, f"bf16: relative RMS error {error:.3f} vs fp32"


def check_mixed_precision(name, device="cpu"):
    """Training in bf16 or fp16 (``train.precision``): the weights taken from a teacher in that dtype, the mixer's own
    new tensors in fp32, under autocast on ``device`` (the GPU check runs it on CUDA, through the Triton kernels).
    The forward stays close to fp32 (relative RMS error below 5%) and every own tensor that takes a gradient gets a
    finite fp32 one."""
    from .core.attention import TEACHER_MODULES

    device = torch.device(device)
    ids, mask = (t.to(device) for t in _inputs())
    valid = mask.bool()
    for dtype in (torch.bfloat16, torch.float16):
        model = tiny_model(name, dtype=torch.float32).to(device).train()
        reference = _logits(model, ids, mask)
        own = []
        for key, parameter in model.named_parameters():
            if ".mixer." in key and not any(f".{module}." in key for module in TEACHER_MODULES):
                own.append((key, parameter))  # stays fp32 and trains
            else:
                parameter.data = parameter.data.to(dtype)
                parameter.requires_grad_(False)
        with torch.autocast(device.type, dtype=dtype):
            logits = model(ids, attention_mask=mask, use_cache=False).logits.float()
        error = ((logits.detach() - reference)[valid].pow(2).mean() / reference[valid].pow(2).mean()).sqrt().item()
        assert error < 0.05, f"{dtype} weights + autocast on {device}: relative RMS error {error:.3f} vs fp32"
        if own:
            logits[valid].pow(2).mean().backward()
            graded = [(key, p.grad) for key, p in own if p.grad is not None]
            assert graded, f"{dtype} weights + autocast: none of the mixer's own tensors got a gradient"
            bad = [key for key, grad in graded if grad.dtype != torch.float32 or not torch.isfinite(grad).all()]
            assert not bad, f"{dtype} weights + autocast on {device}: gradients not finite fp32 for {bad[:3]}"


def check_gradient_checkpointing(name):
    """Gradient checkpointing gives the same gradients."""
    ids, mask = _inputs()
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(name).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, attention_mask=mask, use_cache=False).logits.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys(), "gradient checkpointing: other parameters get gradients"
    for key in grads[0]:
        _close(grads[1][key], grads[0][key], f"gradient checkpointing: gradient of {key}")


# a teacher family's tiny config differs from TINY only where that family does (Qwen3: head_dim != hidden / heads)
FAMILY_FIELDS = {"qwen3": {"head_dim": 16}}


def tiny_teacher(family: str, **fields):
    """A random tiny causal LM of a supported teacher family (conversion/families.py), built by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**TINY, "sliding_window": None, **FAMILY_FIELDS.get(family, {}),
                                             **fields})
    return AutoModelForCausalLM.from_config(config)


def _from_attention_errors(name, length: int = 10, **overrides) -> dict:
    """{"kind/family": relative error} of from_attention on a tiny teacher of every supported family, on ``length``
    tokens, for every converted kind of ``name`` with the options convert would use (plus ``overrides``)."""
    from .conversion.families import SUPPORTED_FAMILIES, backbone_fields
    from .core.attention import attention_output_error

    errors = {}
    for kind in sorted({k for k in _layer_types(name) if not get_mixer(k).is_teacher_attention} or {name}):
        spec = get_mixer(kind)
        for family in SUPPORTED_FAMILIES:
            torch.manual_seed(0)
            teacher = tiny_teacher(family, num_hidden_layers=1).double().eval()
            options = {**spec.tiny_options, **spec.conversion_options, **_variant(name)[1]}  # what convert uses
            options.update({key: value for key, value in overrides.items() if key.startswith(f"{kind}_")})
            # a window longer than the test tokens: a sliding layer then equals its (full-attention) teacher
            fields = {**backbone_fields(teacher.config), "sliding_window": length + 6}
            config = config_class(kind)(**fields, layer_types=[kind], **options)
            config._attn_implementation = "sdpa"
            hidden = torch.randn(2, length, TINY["hidden_size"], dtype=torch.float64)
            positions = teacher.model.rotary_emb(hidden, torch.arange(length)[None])
            attention = teacher.model.layers[0].self_attn
            mixer = spec.mixer_class.from_attention(attention, config, 0, calibration_hidden_states=hidden,
                                                    calibration_position_embeddings=positions).eval()
            error = attention_output_error(mixer, attention, hidden, positions)
            assert error == error and error < float("inf"), f"from_attention ({kind}, {family}): non-finite output"
            errors[f"{kind}/{family}"] = error
    return errors


def check_from_attention(name):
    """from_attention on a tiny teacher of every supported family: a finite output and a measured at-init error (zero
    for a spec that declares exact_at_init). Returns {"kind/family": error}."""
    errors = _from_attention_errors(name)
    for key, error in errors.items():
        if get_mixer(key.split("/")[0]).exact_at_init:
            assert error < 1e-9, f"from_attention ({key}): error {error:.2e} but exact_at_init"
    return errors


def check_window_exact_at_init(name):
    """A mixer with a local-window option (``<mixer>_window``, core/window.py), converted: on sequences no longer
    than the window it is its teacher exactly; on longer ones its memory takes part (a nonzero error)."""
    windowed = [kind for kind in set(_layer_types(name))
                if any(option.name == f"{kind}_window" for option in get_mixer(kind).options)]
    for kind in windowed:
        option = f"{kind}_window"
        try:  # a variant may refuse the window (selective_ssm's s4d has no q/k to attend with): by the option's name
            config_class(kind)(**TINY, **{**get_mixer(kind).tiny_options, **get_mixer(kind).conversion_options,
                                          **_variant(name)[1], option: 4})
        except ValueError as error:
            assert option in str(error), f"{option}: refused without naming the option ({error})"
            continue
        within = _from_attention_errors(name, length=10, **{f"{kind}_window": 10})
        beyond = _from_attention_errors(name, length=10, **{f"{kind}_window": 4})
        for key, error in within.items():
            if key.startswith(f"{kind}/"):
                assert error < 1e-12, f"{kind}_window=10 on 10 tokens: error {error:.2e}, not the teacher"
                assert beyond[key] > 1e-6, f"{kind}_window=4 on 10 tokens: the memory never took part"


CHECKS = (check_config, check_forward_backward, check_block_compiles_whole, check_gradcheck,
          check_decode_equals_forward, check_compiled_decode, check_chunked_prefill, check_padding, check_generate,
          check_remote_code, check_bf16, check_mixed_precision, check_gradient_checkpointing, check_from_attention,
          check_window_exact_at_init)


def check_mixer(name: str) -> None:
    """Run every contract check on registered mixer ``name``; an AssertionError names the failed property."""
    mixer, _ = _variant(name)  # unknown names fail here, by name
    if mixer != HYBRID:
        get_mixer(mixer)
    for check in CHECKS:
        check(name)
