"""hf_mixers/serving/state.py: a constant-state mixer's decode state kept in fixed per-sequence slots (what vLLM's
state cache holds) and read back gives the same next token outputs as the state itself, before and after its
window's memory first exists."""

import pytest
import torch

from hf_mixers.serving import servable_reason, state_window
from hf_mixers.serving.state import pack, state_layout, unpack
from hf_mixers.testing import tiny_config, tiny_model

pytestmark = pytest.mark.unit

MIXERS = ["rsa", "rsa[window]", "selective_ssm", "selective_ssm[window]", "vort", "vort[no_window]", "gltm",
          "gltm[local]", "gltm[ssm]"]  # GLTM's evicting patterns: local and ssm keep zero-width parts


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize("prompt", [2, 9])
def test_a_state_kept_in_slots_continues_as_the_state_itself(name, prompt):
    model = tiny_model(name)
    mixer, rotary = model.model.layers[0].mixer, model.model.rotary_emb
    layout = state_layout(mixer, rotary, state_window(model.config))
    assert len(layout.shapes[-1]) == 1 and layout.dtypes[-1] == torch.uint8 and layout.nbytes % 8 == 0
    sizes = [torch.empty((), dtype=dtype).element_size() for dtype in layout.dtypes]
    assert sizes == sorted(sizes, reverse=True)  # packed back to back in one page, every tensor starts aligned
    slots = [torch.full((3, *shape), 7, dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    before = [tensor.clone() for tensor in slots]
    x = torch.randn(1, prompt + 2, model.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(prompt + 2)[None]
    cos, sin = rotary(x, positions)
    with torch.no_grad():
        _, state, history = mixer.mix(x[:, :prompt], (cos[:, :prompt], sin[:, :prompt]))
        pack(layout, (state, history), slots, [1])
        kept_state, kept_history = unpack(layout, slots, [1])
        for step in range(prompt, prompt + 2):
            embeddings = (cos[:, step:step + 1], sin[:, step:step + 1])
            expected, state, history = mixer.mix(x[:, step:step + 1], embeddings, None, state, history)
            got, kept_state, kept_history = mixer.mix(x[:, step:step + 1], embeddings, None, kept_state,
                                                      kept_history)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            pack(layout, (kept_state, kept_history), slots, [1])
            kept_state, kept_history = unpack(layout, slots, [1])
    assert all(torch.equal(tensor[[0, 2]], old[[0, 2]]) for tensor, old in zip(slots, before))  # the others kept


def test_a_state_part_that_is_not_a_tensor_is_named():
    model = tiny_model("rsa")
    mixer = model.model.layers[0].mixer
    original = mixer.mix
    mixer.mix = lambda *args, **kwargs: (*original(*args, **kwargs)[:2], "history")
    with pytest.raises(TypeError, match="a state holds a str"):
        state_layout(mixer, model.model.rotary_emb)


def test_what_vllm_cannot_serve_is_refused_by_name():
    assert servable_reason(tiny_config("rsa[window]")) is None
    assert servable_reason(tiny_config("rsa", layer_types=["rsa", "full_attention", "sliding_attention"],
                                       num_hidden_layers=3)) is None
    assert "layer 0 is 'sessa', whose decode cache keeps tokens" in servable_reason(tiny_config("sessa"))
    assert servable_reason(tiny_config("gltm", layer_types=["full_attention", "gltm"])) is None  # pow2_ce evicts
    assert "layer 1 is 'gltm'" in servable_reason(tiny_config("gltm[dense]", layer_types=["full_attention", "gltm"]))
    assert "layers of ['rsa', 'vort']: vLLM gives every state layer" in servable_reason(
        tiny_config("rsa", layer_types=["rsa", "vort"]))
    assert state_window(tiny_config("rsa[window]")) == 3 and state_window(tiny_config("rsa")) == 0


@pytest.mark.parametrize("name", ["rsa[window]", "selective_ssm", "vort", "gltm"])
def test_slots_read_and_written_as_one_batch_equal_each_sequence_alone(name):
    """An engine steps its decoding sequences in one call: their slots (any rows, in any order) unpacked as one
    batch, one token each, and packed back give what each sequence's own call gives."""
    model = tiny_model(name)
    mixer, rotary = model.model.layers[0].mixer, model.model.rotary_emb
    layout = state_layout(mixer, rotary, state_window(model.config))
    slots = [torch.zeros((4, *shape), dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    x = torch.randn(2, 11, model.config.hidden_size, dtype=torch.float64)
    cos, sin = rotary(x, torch.arange(11)[None])
    alone = []
    with torch.no_grad():
        for row, (length, slot) in enumerate(((7, 2), (9, 0))):  # both past the window: the same parts
            _, state, history = mixer.mix(x[row:row + 1, :length], (cos[:, :length], sin[:, :length]))
            pack(layout, (state, history), slots, [slot])
            step = (cos[:, length:length + 1], sin[:, length:length + 1])
            alone.append(mixer.mix(x[row:row + 1, length:length + 1], step, None, state, history)[0])
        state, history = unpack(layout, slots, [2, 0])
        positions = torch.tensor([[7], [9]])
        together, state, history = mixer.mix(torch.stack([x[0, 7:8], x[1, 9:10]]), rotary(x, positions), None,
                                             state, history)
        torch.testing.assert_close(together, torch.cat(alone), rtol=1e-12, atol=1e-12)
        pack(layout, (state, history), slots, [2, 0])
        assert unpack(layout, slots, [0])[0] is not None


@pytest.mark.parametrize("name", ["gltm", "gltm[local]", "gltm[banded]", "gltm[ssm]", "gltm[quad_ce]"])
def test_a_gltm_evicting_cache_as_a_state_equals_the_full_forward(name):
    """GLTM's ``mix`` (an evicting pattern's cache at fixed slots, what a state slot keeps): two prompts of 5 and
    9 tokens left-padded into one call, then three tokens together, equal each sequence's one full forward, in
    fp64; the kept slots never exceed the fixed count."""
    model = tiny_model(name)
    mixer, rotary = model.model.layers[0].mixer, model.model.rotary_emb
    x = torch.randn(2, 12, model.config.hidden_size, dtype=torch.float64)
    lengths = (5, 9)
    with torch.no_grad():
        alone = [mixer(x[row:row + 1, :length + 3], rotary(x, torch.arange(length + 3)[None]))
                 for row, length in enumerate(lengths)]
        real = torch.arange(9)[None] >= torch.tensor([[4], [0]])  # (2, 9): the first prompt padded in front
        prompts = torch.stack([torch.cat([x.new_zeros(4, x.shape[-1]), x[0, :5]]), x[1, :9]])
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        out, state, _ = mixer.mix(prompts, rotary(x, positions), real)
        steps = []
        for step in range(3):
            tokens = torch.stack([x[row, length + step] for row, length in enumerate(lengths)])[:, None]
            position = torch.tensor([[length + step] for length in lengths])
            got, state, _ = mixer.mix(tokens, rotary(x, position), None, state)
            steps.append(got)
            assert state.positions.shape[1] == mixer.decode_slots(model.config.max_position_embeddings)
    for row, length in enumerate(lengths):
        served = torch.cat([out[row:row + 1, 9 - length:], *[got[row:row + 1] for got in steps]], dim=1)
        torch.testing.assert_close(served, alone[row], rtol=1e-10, atol=1e-10)
    assert state.seen.flatten().tolist() == [8, 12]


def test_a_gltm_cache_that_keeps_every_position_is_no_state():
    mixer = tiny_model("gltm[dense]").model.layers[0].mixer
    with pytest.raises(ValueError, match="GLTM layer 0: pattern 'dense' keeps every position"):
        mixer.mix(torch.randn(1, 3, mixer.config.hidden_size, dtype=torch.float64))


def test_pip_install_with_the_vllm_extra_brings_vllm_and_registers_the_plugin():
    """``pip install "hf-mixers[vllm]"`` pulls vLLM, and the package declares its plugin in the entry-point group vLLM
    loads at start-up, pointing at the function that registers the model class."""
    import importlib
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == ["vllm"]
    module, _, function = project["entry-points"]["vllm.general_plugins"]["hf_mixers"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
