"""The whole stack's token step as one compiled graph (decode/engine.py ``stack_compiles_decode``): taken on CUDA when
every layer has a compiled step of fixed shapes and the mode replays CUDA graphs, equal to the eager decode and to
one full forward, one graph for every step; every other model, and a call that must see each block, goes block by
block. On the CPU, where the stack does not pay, these tests let it run (``STACK_DEVICES``): the same code but for
the CUDA graph's replay, which a stand-in replays into fixed buffers."""

import pytest
import torch

from hf_mixers.core.cache import map_tensors
from hf_mixers.decode import engine
from hf_mixers.testing import HYBRID, _decode, _inputs, _logits, tiny_config

STATIC = ["rsa", "vort", "selective_ssm", "gltm"]  # every mixer whose compiled step has fixed shapes
STACKED = ["rsa", "vort"]  # the stacks Inductor compiles here


@pytest.fixture(autouse=True)
def stack_on_cpu(monkeypatch):
    monkeypatch.setattr(engine, "STACK_DEVICES", ("cuda", "cpu"))


def mixed_model(layer_types, dtype=torch.float64, seed=0, **overrides):
    """A tiny model whose layers are ``layer_types`` (every mixer's tiny options in its config)."""
    from hf_mixers.model.modeling import MixerForCausalLM

    config = tiny_config(HYBRID, layer_types=list(layer_types), num_hidden_layers=len(layer_types), **overrides)
    torch.manual_seed(seed)
    return MixerForCausalLM(config).to(dtype).eval()


def eager_and_compiled(layer_types):
    """(the model compiling its decode with "reduce-overhead", ids, mask, the eager model's full forward and its
    decode) on a left-padded batch; dynamo's graphs and counters fresh."""
    eager = mixed_model(layer_types)
    compiled = mixed_model(layer_types, compile_decode="reduce-overhead")
    ids, mask = _inputs()
    full, reference = _logits(eager, ids, mask), _decode(eager, ids, mask)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return compiled, ids, mask, full, reference


def assert_equal_to_eager(stepped, full, reference, mask):
    """fp32 precision, not fp64's: the compiled graph sums in another order."""
    valid = mask.bool()
    torch.testing.assert_close(stepped[valid], reference[valid], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped[valid], full[valid], rtol=1e-4, atol=1e-5)


@pytest.fixture
def compiled_functions(monkeypatch):
    """The names of the functions decode_compiled compiles, in order; dynamo's eager backend stands in for inductor
    (the graph count and the dispatch are dynamo's and ours, and it compiles in milliseconds)."""
    compile_ = torch.compile
    names = []

    def compile_eagerly(function, mode=None, options=None, **kwargs):
        names.append(function.__name__)
        return compile_(function, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "EXPORT_DEVICES", ())  # which function torch.compile gets: no exported step
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return names


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_the_stack_compiles_as_one_graph_equal_to_eager_and_one_forward():
    """Inductor, "reduce-overhead" (on CPU: the default mode, no CUDA graph): two kinds of mixer in one graph, every
    step after the first replays it (no recompile), equal to the eager decode and to one forward on a left-padded
    batch. Every kind at once: test_a_cuda_graph_mode_takes_the_stack, through dynamo (Inductor's code for the four
    took 70 s a test on 2 cores; each kind's block step is Inductor's in the contract suite)."""
    layer_types = STACKED
    compiled, ids, mask, full, reference = eager_and_compiled(layer_types)
    counters = torch._dynamo.utils.counters
    stepped = _decode(compiled, ids, mask)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [key[1] for key in engine._compiled_steps if len(key[1]) == len(layer_types)], "the stack did not compile"
    assert_equal_to_eager(stepped, full, reference, mask)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_cuda_graph_mode_takes_the_stack(mode, compiled_functions):
    eager = mixed_model(STATIC, dtype=torch.float32)
    compiled = mixed_model(STATIC, dtype=torch.float32, compile_decode=mode)
    ids, mask = _inputs()
    torch.testing.assert_close(_decode(compiled, ids, mask), _decode(eager, ids, mask), rtol=1e-5, atol=1e-6)
    assert compiled_functions == ["stack_step"]


def test_the_default_mode_goes_block_by_block(compiled_functions):
    """On CPU the default mode's C++ launcher would be one source file for the whole stack: a graph per block."""
    compiled = mixed_model(STATIC, dtype=torch.float32, compile_decode=True)
    _decode(compiled, *_inputs())
    assert compiled_functions == ["block_step"] * len(STATIC)


def test_a_growing_cache_in_the_stack_goes_block_by_block(compiled_functions):
    """Sessa's step has symbolic shapes (its cache grows): never a CUDA graph, so neither is the stack around it."""
    compiled = mixed_model(["rsa", "sessa"], dtype=torch.float32, compile_decode="reduce-overhead")
    _decode(compiled, *_inputs())
    assert compiled_functions == ["block_step", "block_step"]


def test_a_layer_without_a_compiled_step_goes_block_by_block(compiled_functions):
    compiled = mixed_model(["rsa", "full_attention"], dtype=torch.float32, compile_decode="reduce-overhead")
    _decode(compiled, *_inputs())
    assert compiled_functions == ["block_step"]


def test_a_block_with_a_hook_is_called_at_every_step(compiled_functions):
    compiled = mixed_model(["rsa", "vort"], dtype=torch.float32, compile_decode="reduce-overhead")
    calls = []
    compiled.model.layers[1].register_forward_hook(lambda module, args, output: calls.append(output.shape[1]))
    ids, mask = _inputs()
    _decode(compiled, ids, mask, prefill=5)
    assert calls == [5] + [1] * (ids.shape[1] - 5)
    assert compiled_functions == ["block_step", "block_step"]


def test_hidden_states_asked_for_are_every_blocks(compiled_functions):
    """output_hidden_states records each block's output: such a step goes block by block, and says the same as
    eager; transformers' recording hook, installed then, does not keep later steps off the stack."""
    from transformers import DynamicCache

    eager = mixed_model(["rsa", "vort"], dtype=torch.float32)
    compiled = mixed_model(["rsa", "vort"], dtype=torch.float32, compile_decode="reduce-overhead")
    ids, mask = _inputs()
    states = []
    for model in (eager, compiled):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache, use_cache=True)
            states.append(model(ids[:, 5:6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True,
                                output_hidden_states=True).hidden_states)
            assert len(states[-1]) == 3
            model(ids[:, 6:7], attention_mask=mask[:, :7], past_key_values=cache, use_cache=True)
    for expected, actual in zip(*states):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert compiled_functions == ["block_step", "block_step", "stack_step"]


def test_a_stack_replayed_into_reused_buffers_is_copied_out(monkeypatch):
    """A CUDA graph's replay writes the same output memory every time (cudagraph trees reuse it, and invalidate what
    a replay returned once the next step begins); stood in for on the CPU by the eager stack step writing into fixed
    buffers. The cache holds copies: the states handed to the next replay never lie in the memory the last replay
    wrote, and decoding equals eager."""

    def addresses(value) -> set:
        return {tensor.data_ptr() for tensor in engine._leaves(value) if tensor.numel()}

    def replayed(function):
        buffers = {}

        def replay(*args):
            if "out" in buffers:  # args[3]: every block's inputs, the states the cache holds among them
                assert not addresses(buffers["out"]) & addresses(args[3]), "a state still in the replay's memory"
            outputs = function(*args)
            if "out" not in buffers:
                buffers["out"] = map_tensors(outputs, torch.Tensor.clone)
            for held, fresh in zip(engine._leaves(buffers["out"]), engine._leaves(outputs), strict=True):
                held.copy_(fresh)
            return buffers["out"]

        return replay

    monkeypatch.setattr(engine, "_compiled_steps", {})
    monkeypatch.setattr(engine, "compile_step",
                        lambda function, device, mode=None, dynamic=False: (replayed(function), True))
    eager = mixed_model(STATIC, dtype=torch.float32)
    stepped = mixed_model(STATIC, dtype=torch.float32, compile_decode="reduce-overhead")
    ids, mask = _inputs()
    torch.testing.assert_close(_decode(stepped, ids, mask), _decode(eager, ids, mask), rtol=1e-5, atol=1e-6)
    assert [len(key[1]) for key in engine._compiled_steps] == [len(STATIC)]


def test_off_cuda_the_stack_is_not_taken(monkeypatch, compiled_functions):
    """Without a CUDA graph to replay, the whole stack does not pay (its kernels launched from Python): a CPU model
    compiles block by block, "reduce-overhead" there being the default mode (with the C++ launcher)."""
    monkeypatch.setattr(engine, "STACK_DEVICES", ("cuda",))
    compiled = mixed_model(["rsa", "vort"], dtype=torch.float32, compile_decode="reduce-overhead")
    _decode(compiled, *_inputs())
    assert compiled_functions == ["block_step", "block_step"]
    assert not engine.compile_step(engine.block_step, "cpu", "reduce-overhead")[1]


@pytest.fixture
def in_place(monkeypatch):
    monkeypatch.setattr(engine, "IN_PLACE_DEVICES", ("cpu",))
    monkeypatch.setattr(engine, "_fixed_points", set())


def _state_pointers(model, cache, layer_types) -> list:
    """Where each layer's state tensors (``TokenStep.replaced``) are; not RSA's, which on a CPU refreshes its
    references on the host after the graph (``RSAMixer.references_refreshed``: new tensors at each chunk boundary; in
    the graph on CUDA)."""
    pointers = []
    for block, layer, kind in zip(model.model.layers, cache.layers, layer_types):
        step = type(block.mixer).token_step
        if kind != "rsa":
            pointers += [tensor.data_ptr() for tensor in
                         engine._leaves(step.replaced(block.mixer, step.inputs(block.mixer, layer, None)))]
    return pointers


@pytest.mark.variant  # an Inductor compile of its own (~10-30 s on a clean cache): the full tier
def test_in_place_states_equal_eager_and_keep_their_memory(in_place):
    """IN_PLACE_DEVICES (off by default, until a GPU measures it): once a step's new states have their inputs'
    shapes, the next steps write them into the cache's own tensors (Inductor, one more graph, none after), equal to
    the eager decode and to one forward; the cache's state tensors then stay where they are."""
    from transformers import DynamicCache

    layer_types = STACKED
    compiled, ids, mask, full, reference = eager_and_compiled(layer_types)
    cache = DynamicCache(config=compiled.config)
    steps = [_logits(compiled, ids[:, :5], mask[:, :5], past_key_values=cache, use_cache=True)]
    pointers = []
    for t in range(5, ids.shape[1]):
        steps.append(_logits(compiled, ids[:, t:t + 1], mask[:, :t + 1], past_key_values=cache, use_cache=True))
        pointers.append(_state_pointers(compiled, cache, layer_types))
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 2, dict(stats)  # as returned, then in place
    assert pointers[1] == pointers[-1], "the in-place steps moved the cache's states"
    assert_equal_to_eager(torch.cat(steps, 1), full, reference, mask)


def test_a_state_that_changes_shape_is_returned_until_it_settles(in_place, compiled_functions):
    """With a window longer than the prompt, RSA's memory is empty (None) until the first token leaves the window:
    those steps return their state; in place from the step whose new state has its inputs' structure on."""
    eager = mixed_model(["rsa", "vort"], dtype=torch.float32, rsa_window=8)
    compiled = mixed_model(["rsa", "vort"], dtype=torch.float32, rsa_window=8, compile_decode="reduce-overhead")
    ids, mask = _inputs(length=16)
    torch.testing.assert_close(_decode(compiled, ids, mask), _decode(eager, ids, mask), rtol=1e-5, atol=1e-6)
    assert compiled_functions == ["stack_step", "stack_step_in_place"]


def test_a_stack_that_cannot_be_built_here_runs_block_by_block_then_eagerly(monkeypatch):
    """Where the whole stack's graph fails to build (a backend error), the token goes block by block; where a block's
    fails too, that block decodes eagerly: the same tokens as the eager model, and each failed key remembered (the
    stack's and each block's), so later tokens do not try again."""
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler here")

    for name, value in (("COMPILE_BACKEND", broken_backend), ("EXPORT_DEVICES", ()), ("_compiled_steps", {}),
                        ("_eager_keys", set()), ("_ran", set())):
        monkeypatch.setattr(engine, name, value)
    compiled, ids, mask, full, reference = eager_and_compiled(STACKED)
    stepped = _decode(compiled, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(stepped[valid], reference[valid])  # eager all the way: fp64's precision
    assert sorted(len(key[1]) for key in engine._eager_keys) == [1, 1, 2]  # the stack, then each block
