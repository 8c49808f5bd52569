"""decode/exported.py: a block's token step as an AOTInductor library, on a toy block (each library is a real
build, ~5-10 s here: a module-wide cache folder keeps them for the tests that follow)."""

import logging
import os
import stat

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig

from hf_mixers.core.cache import map_tensors
from hf_mixers.decode import exported as exported_step


class ToyMixer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(8, 8)
        self.scale = 2.0


class ToyBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mixer = ToyMixer(config)


def toy_step(block, hidden_states, position_embeddings, inputs):
    """A block step's shape: (B, 1, D), (cos, sin), (mask, state) -> output and a new state of the same structure."""
    mask, (memory, count) = inputs
    cos, sin = position_embeddings
    mixed = block.mixer.proj(block.norm(hidden_states)) * block.mixer.scale + block.mixer.config.toy_bias
    memory = memory * 0.5 + mixed[:, 0] * cos[:, 0] * mask - sin[:, 0]
    return hidden_states + mixed, (memory, count + mask.long())


def toy_inputs(seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 1, 8, generator=generator, dtype=dtype)
    cos, sin = torch.randn(2, 1, 8, generator=generator, dtype=dtype), torch.randn(2, 1, 8, generator=generator,
                                                                                   dtype=dtype)
    mask = torch.tensor([[1.0], [0.0]], dtype=dtype)
    return hidden, (cos, sin), (mask, (torch.randn(2, 8, generator=generator, dtype=dtype),
                                       torch.tensor([3, 4])))


def toy_block(seed=0):
    torch.manual_seed(seed)
    config = PretrainedConfig()
    config.toy_bias = 0.25
    return ToyBlock(config).eval()


def run(block, inputs, function=toy_step):
    return exported_step.run_exported_step(function, block, *inputs, dict)


def assert_equals_eager(block, inputs, result):
    assert result is not None, "the call fell back to torch.compile"
    output, (memory, count) = result
    want_output, (want_memory, want_count) = toy_step(block, *inputs)
    torch.testing.assert_close(output, want_output)
    torch.testing.assert_close(memory, want_memory)
    assert torch.equal(count, want_count)


@pytest.fixture(autouse=True)
def fresh(tmp_path_factory, monkeypatch):
    """One cache folder for the module (each test starts with nothing loaded, the libraries built before on disk),
    autograd off as in generation."""
    monkeypatch.setenv("HF_MIXERS_CACHE", str(tmp_path_factory.getbasetemp() / "exported-step-cache"))
    exported_step.reset()
    with torch.no_grad():
        yield
    exported_step.reset()


def test_one_library_serves_every_block_and_every_token_and_equals_eager():
    first, second = toy_block(0), toy_block(1)  # two layers: their own weights, one structure
    for seed in range(3):  # tokens: new values, the same layouts
        assert_equals_eager(first, toy_inputs(seed), run(first, toy_inputs(seed)))
        assert_equals_eager(second, toy_inputs(seed), run(second, toy_inputs(seed)))
    assert exported_step.counts["exported"] == 1 and exported_step.counts["loaded"] == 1
    assert exported_step.counts["described"] == 2  # once a block: later tokens run on its memo


def test_libraries_are_kept_on_disk():
    block = toy_block()
    run(block, toy_inputs())
    exported_step.reset()  # a later process: nothing loaded
    assert_equals_eager(block, toy_inputs(1), run(block, toy_inputs(1)))
    assert exported_step.counts == {"exported": 1, "built": 0, "loaded": 1, "described": 1}
    folder = exported_step.cache_folder()
    files = os.listdir(folder)
    assert files and all(name.endswith(".pt2") and not name.startswith(".partial") for name in files)
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) for name in files} == {0o666 & ~umask}


@pytest.mark.variant  # a library build each (~5 s): the full tier only
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_broken_cache_entry_is_named_removed_and_built_again(damage, caplog):
    """A real library on disk, then damaged as a full disk or a stray write would leave it: the next process names
    the file, removes it and builds it again, instead of falling back to torch.compile in every later process."""
    block = toy_block()
    run(block, toy_inputs())
    folder = exported_step.cache_folder()
    path = os.path.join(folder, next(name for name in os.listdir(folder) if name.endswith(".pt2")))
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(data[:len(data) // 3] if damage == "truncated" else os.urandom(4096))
    exported_step.reset()  # a later process
    with caplog.at_level(logging.WARNING, logger=exported_step.logger.name):
        assert_equals_eager(block, toy_inputs(1), run(block, toy_inputs(1)))
    assert exported_step.counts["built"] == 1 and exported_step.counts["loaded"] == 1
    assert f"the compiled-steps cache entry {path} cannot be loaded" in caplog.text
    exported_step.reset()
    run(block, toy_inputs(2))
    assert exported_step.counts["built"] == 0  # the rebuilt entry serves the next process


@pytest.mark.variant  # a library build each (~5 s): the full tier only
def test_a_changed_attribute_config_or_weight_is_seen():
    block = toy_block()
    inputs = toy_inputs()
    run(block, inputs)
    block.mixer.scale = 3.0  # an attribute the trace read: another program
    assert_equals_eager(block, inputs, run(block, inputs))
    built = exported_step.counts["built"]
    block.mixer.config.toy_note = "unread"  # the config's contents: exported again (a program the same as the last
    assert_equals_eager(block, inputs, run(block, inputs))  # one, so its library comes from disk)
    assert exported_step.counts["exported"] == 3 and exported_step.counts["built"] == built
    block.mixer.scale = 2.0
    del block.mixer.config.toy_note  # back: the first library again, not a new one
    assert_equals_eager(block, inputs, run(block, inputs))
    block.mixer.proj.weight = nn.Parameter(torch.randn(8, 8))  # a replaced parameter: its new values are read
    assert_equals_eager(block, inputs, run(block, inputs))
    with torch.no_grad():
        block.mixer.proj.weight.mul_(2.0)  # changed in place: read as it is
    assert_equals_eager(block, inputs, run(block, inputs))
    assert exported_step.counts["exported"] == 3


@pytest.mark.variant  # a library build each (~5 s): the full tier only
def test_a_new_dtype_is_caught_by_the_library_and_gets_its_own():
    block = toy_block()
    run(block, toy_inputs())
    block.double()  # the parameters keep their identity, their data changes dtype: the library's input check sees it
    inputs = toy_inputs(dtype=torch.float64)
    assert_equals_eager(block, inputs, run(block, inputs))
    assert exported_step.counts["exported"] == 2 and run(block, inputs)[0].dtype == torch.float64
    assert exported_step.INPUT_CHECKS not in os.environ  # set for each library's first call only


def test_a_library_checks_its_inputs_with_nothing_left_in_the_environment():
    """AOTI_RUNTIME_CHECK_INPUTS is set only around a library's first call, yet the library keeps checking: a call
    of its runner with inputs of another dtype is refused by the library itself (what run_exported_step relies on
    to describe a block again)."""
    block = toy_block()
    inputs = toy_inputs()
    run(block, inputs)
    assert exported_step.INPUT_CHECKS not in os.environ
    memo, step_tensors = exported_step._memos[block], []
    exported_step._flatten(inputs, step_tensors)
    wrong = [tensor.double() if tensor.is_floating_point() else tensor for tensor in step_tensors]
    with pytest.raises(RuntimeError, match="unmatched dtype"):
        memo.step.runner.boxed_run([*memo.tensors, *wrong])


def test_calls_a_library_cannot_serve_fall_back():
    block = toy_block()
    inputs = toy_inputs()
    with torch.enable_grad():
        assert run(block, inputs) is None  # its outputs would carry no autograd graph
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run(block, inputs) is None
    handle = block.mixer.proj.register_forward_hook(lambda module, args, output: output * 0)
    assert run(block, inputs) is None  # a library would skip the hook
    handle.remove()
    assert exported_step.counts["exported"] == 0
    handle = block.register_forward_hook(lambda module, args, output: output)
    assert_equals_eager(block, inputs, run(block, inputs))  # the block's own hooks run around its forward: served
    handle.remove()
    with torch.inference_mode():  # generation under inference mode: served
        assert_equals_eager(block, toy_inputs(1), run(block, toy_inputs(1)))
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: output)
    assert run(block, inputs) is None  # a global hook: torch.compile's step runs it
    handle.remove()


def test_a_torch_without_the_global_hook_registry_falls_back(monkeypatch):
    """The global hooks are read from torch's private dicts (no public reader): where a torch version lacks them,
    every call goes to torch.compile rather than past a hook the library cannot see."""
    block, inputs = toy_block(), toy_inputs()
    monkeypatch.delattr(torch.nn.modules.module, "_global_forward_hooks")
    assert run(block, inputs) is None and exported_step.counts["exported"] == 0


def test_a_step_that_cannot_be_exported_falls_back_once(caplog):
    def data_dependent(block, hidden_states, position_embeddings, inputs):
        if hidden_states.sum() > 0:  # a branch on a value: no static program
            return toy_step(block, hidden_states, position_embeddings, inputs)
        return toy_step(block, -hidden_states, position_embeddings, inputs)

    block = toy_block()
    with caplog.at_level(logging.WARNING, logger="hf_mixers.decode.exported"):
        assert run(block, toy_inputs(), data_dependent) is None
        assert run(block, toy_inputs(1), data_dependent) is None
    warnings = [record for record in caplog.records if "could not be compiled ahead of time" in record.message]
    assert len(warnings) == 1, "the failure is said once, and the key is not exported again"


@pytest.mark.variant  # a library build each (~5 s): the full tier only
def test_a_library_is_checked_on_each_block_it_serves(caplog):
    """The key leaves out ``layer_idx`` (no step should read it: one library serves every layer); a step that reads
    it anyway gets its library checked on each block against that block's eager step, and the block whose program
    differs runs through torch.compile."""
    def reads_the_layer(block, hidden_states, position_embeddings, inputs):
        output, state = toy_step(block, hidden_states, position_embeddings, inputs)
        return output * (1 + block.mixer.layer_idx), state

    first, second = toy_block(0), toy_block(0)
    first.mixer.layer_idx, second.mixer.layer_idx = 0, 1
    inputs = toy_inputs()
    assert run(first, inputs, reads_the_layer) is not None
    with caplog.at_level(logging.WARNING, logger="hf_mixers.decode.exported"):
        assert run(second, inputs, reads_the_layer) is None
        assert run(second, toy_inputs(1), reads_the_layer) is None  # its memo says so: no second check
    assert sum("differs from this block's eager step" in record.message for record in caplog.records) == 1
    assert run(first, toy_inputs(1), reads_the_layer) is not None  # the block it was built on keeps it


@pytest.mark.variant  # a library build each (~5 s): the full tier only
def test_a_step_that_writes_its_state_in_place_is_checked_on_copies():
    """A step may write its state into its input in place (the local window's ring buffer): the library's first-use
    check runs the eager step and the library on copies, so the call itself reads the state as it was, and the
    library writes into the caller's tensor."""
    def in_place_step(block, hidden_states, position_embeddings, inputs):
        mask, (memory, count) = inputs
        mixed = block.mixer.proj(block.norm(hidden_states))
        output = hidden_states + mixed + memory[:, None]  # reads the state before it is written
        memory.mul_(0.5).add_(mixed[:, 0] * mask)
        return output, (memory, count + mask.long())

    block = toy_block()
    for seed in (0, 1):  # the first call builds and checks the library, the second is served by it
        inputs = toy_inputs(seed)
        expected_output, (expected_memory, _) = in_place_step(block, *map_tensors(inputs, torch.clone))
        result = run(block, inputs, in_place_step)
        assert result is not None, "the library failed its check: it was checked on inputs the eager step had written"
        output, (memory, _) = result
        torch.testing.assert_close(output, expected_output)
        torch.testing.assert_close(memory, expected_memory)
        assert memory.data_ptr() == inputs[2][1][0].data_ptr()  # written into the caller's tensor
