"""q/k/v_proj as one product in the compiled token step (core/attention.py ``fuse_qkv``): no memory of its own, the
same values, never stale, never in the way of autograd, peft or saving."""

import pytest
import torch
from torch import nn

from hf_mixers.testing import tiny_model


def _mixer(bias=False):
    model = tiny_model("rsa", attention_bias=bias)
    return model, model.model.layers[0].mixer


def _three(mixer, x):
    return mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_fusing_stacks_the_weights_in_place_and_changes_no_value(bias):
    model, mixer = _mixer(bias)
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected = _three(mixer, x)
    with torch.no_grad():
        mixer.keep_qkv_fused()
    assert mixer.qkv_fused()
    assert mixer.q_proj.weight.data_ptr() == mixer.qkv_weight.data_ptr()  # views: no second copy of the weights
    assert mixer.qkv_weight.untyped_storage().data_ptr() == mixer.v_proj.weight.untyped_storage().data_ptr()
    assert (mixer.qkv_bias is not None) == bias
    if bias:
        assert mixer.k_proj.bias.untyped_storage().data_ptr() == mixer.qkv_bias.untyped_storage().data_ptr()
    state = model.state_dict()
    assert state.keys() == before.keys()  # the stacked tensors are not saved: the names stay the teacher's
    assert all(torch.equal(state[name], before[name]) for name in before)
    with torch.no_grad():
        fused = mixer.linear_qkv(x)
    for actual, wanted in zip(fused, expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


def test_autograd_still_reaches_the_three_projections():
    model, mixer = _mixer()
    with torch.no_grad():
        mixer.keep_qkv_fused()
    x = torch.randn(1, 3, model.config.hidden_size, dtype=torch.float64)
    sum(part.sum() for part in mixer.linear_qkv(x)).backward()
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
               for layer in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    mixer.unfuse_qkv()
    mixer.keep_qkv_fused()  # with autograd on it never fuses a layer anew
    assert not mixer.qkv_fused()


def test_an_in_place_update_reaches_the_stacked_weights():
    model, mixer = _mixer()
    with torch.no_grad():
        mixer.keep_qkv_fused()
        mixer.k_proj.weight.add_(0.5)  # an optimizer step, load_state_dict: they write in place
        x = torch.randn(1, 2, model.config.hidden_size, dtype=torch.float64)
        torch.testing.assert_close(mixer.linear_qkv(x)[1], mixer.k_proj(x), rtol=1e-12, atol=1e-12)
    assert mixer.qkv_fused()


def test_a_replaced_or_converted_weight_is_never_read_stale():
    model, mixer = _mixer()
    x = torch.randn(1, 2, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        mixer.keep_qkv_fused()
        mixer.v_proj.weight = nn.Parameter(torch.randn_like(mixer.v_proj.weight))  # a load with assign=True
        assert not mixer.qkv_fused()
        torch.testing.assert_close(mixer.linear_qkv(x)[2], mixer.v_proj(x), rtol=1e-12, atol=1e-12)  # eager: three
        mixer.keep_qkv_fused()  # the compiled step stacks them again before it runs
        assert mixer.qkv_fused()
        torch.testing.assert_close(mixer.linear_qkv(x)[2], mixer.v_proj(x), rtol=1e-12, atol=1e-12)
    model.to(torch.bfloat16)  # new storage for every weight: the stacked one is dropped, not converted beside them
    assert mixer.qkv_weight is None and not mixer.qkv_fused()
    with torch.no_grad():
        mixer.keep_qkv_fused()
    assert mixer.qkv_weight.dtype == torch.bfloat16 and mixer.qkv_fused()


def test_peft_wrapped_projections_are_never_fused():
    from peft import LoraConfig, get_peft_model

    model, _ = _mixer()
    with torch.no_grad():
        model.model.layers[0].mixer.keep_qkv_fused()
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    mixer = lora.base_model.model.model.layers[0].mixer
    assert mixer.qkv_projections() is None and not mixer.qkv_fused()
    x = torch.randn(1, 2, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        mixer.keep_qkv_fused()
        assert mixer.qkv_weight is None
        torch.testing.assert_close(mixer.linear_qkv(x)[0], mixer.q_proj(x), rtol=1e-12, atol=1e-12)


def test_a_fused_model_saves_and_loads_as_before(tmp_path):
    from hf_mixers.model.modeling import MixerForCausalLM

    model, _ = _mixer(bias=True)
    with torch.no_grad():
        for block in model.model.layers:
            block.mixer.keep_qkv_fused()
    model.save_pretrained(tmp_path)
    loaded = MixerForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_compiled_step_fuses_where_one_product_measured_faster():
    model, mixer = _mixer()
    for dtype, fused in ((torch.bfloat16, True), (torch.float32, False), (torch.float64, True)):
        model.to(dtype)
        with torch.no_grad():
            mixer.keep_qkv_fused()
        assert mixer.qkv_fused() == fused, dtype  # fp32 on a CPU: three products (one measured 2.5-5% slower)
