"""hf_mixers/serving/state.py: a constant-state mixer's decode state kept in fixed per-sequence slots (what vLLM's
state cache holds) and read back gives the same next token outputs as the state itself, before and after its
window's memory first exists."""

import pytest
import torch

from hf_mixers.serving.state import pack, state_layout, unpack
from hf_mixers.testing import tiny_model

pytestmark = pytest.mark.unit

MIXERS = ["rsa", "rsa[window]", "selective_ssm", "selective_ssm[window]", "vort", "vort[no_window]"]


def _window(config) -> int:
    return max([value for key, value in config.to_dict().items() if key.endswith("_window")
                and isinstance(value, int)] + [0])


@pytest.mark.parametrize("name", MIXERS)
@pytest.mark.parametrize("prompt", [2, 9])
def test_a_state_kept_in_slots_continues_as_the_state_itself(name, prompt):
    model = tiny_model(name)
    mixer, rotary = model.model.layers[0].mixer, model.model.rotary_emb
    layout = state_layout(mixer, rotary, _window(model.config))
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
        pack(layout, (state, history), slots, 1)
        kept_state, kept_history = unpack(layout, slots, 1)
        for step in range(prompt, prompt + 2):
            embeddings = (cos[:, step:step + 1], sin[:, step:step + 1])
            expected, state, history = mixer.mix(x[:, step:step + 1], embeddings, None, state, history)
            got, kept_state, kept_history = mixer.mix(x[:, step:step + 1], embeddings, None, kept_state,
                                                      kept_history)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            pack(layout, (kept_state, kept_history), slots, 1)
            kept_state, kept_history = unpack(layout, slots, 1)
    assert all(torch.equal(tensor[[0, 2]], old[[0, 2]]) for tensor, old in zip(slots, before))  # the others kept


def test_a_state_part_that_is_not_a_tensor_is_named():
    model = tiny_model("rsa")
    mixer = model.model.layers[0].mixer
    original = mixer.mix
    mixer.mix = lambda *args, **kwargs: (*original(*args, **kwargs)[:2], "history")
    with pytest.raises(TypeError, match="a state holds a str"):
        state_layout(mixer, model.model.rotary_emb)
