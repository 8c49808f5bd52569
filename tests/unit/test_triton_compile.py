"""kernels/triton_compile.py: a call's Triton kernels compiled side by side, once per layout.

On CUDA the compiles themselves run (`make gpu-check` times them); here fake kernels stand in for Triton's
``JITFunction`` and check the contract: every warmup runs inside Triton's ``AsyncCompileMode`` (which sends the
compile to the thread pool), with the launch's grid, arguments and constexprs, once per key. That the warmups are
exactly what a call launches is tested per kernel (test_rsa_chunk_triton.py, interpreted).
"""

import logging

import pytest
import torch

pytest.importorskip("triton")
from triton.runtime import _async_compile  # noqa: E402

from hf_mixers.kernels import triton_compile  # noqa: E402


class FakeKernel:
    def __init__(self):
        self.calls = []

    def warmup(self, *args, grid, **constexprs):
        self.calls.append((grid, args, constexprs, _async_compile.active_mode.get() is not None))


def test_each_warmup_runs_once_per_key_inside_async_compile(monkeypatch, caplog):
    monkeypatch.setattr(triton_compile, "_DONE", set())
    forward, backward = FakeKernel(), FakeKernel()
    warmups = [(forward, (4, 2), (torch.ones(2), torch.float32, 3), {"L": 4}),
               (backward, (4, 2), (torch.ones(2), 7), {"LEVEL0": True}),
               (backward, (4, 2), (torch.ones(2), 7), {"LEVEL0": False})]
    with caplog.at_level(logging.INFO, logger="hf_mixers.kernels"):
        assert triton_compile.compile_side_by_side("test read", ("layout", 1), lambda: warmups)
    assert [call[2] for call in backward.calls] == [{"LEVEL0": True}, {"LEVEL0": False}]
    assert forward.calls[0][0] == (4, 2) and forward.calls[0][1][1:] == (torch.float32, 3)
    assert all(call[3] for call in forward.calls + backward.calls), "a warmup ran outside AsyncCompileMode"
    assert _async_compile.active_mode.get() is None  # the mode is left behind the call
    assert "test read: 3 Triton kernels ready" in caplog.text
    assert caplog.records[-1].levelno == logging.INFO  # fast (a cache hit): not in a training log

    assert not triton_compile.compile_side_by_side("test read", ("layout", 1), lambda: warmups)  # done: nothing again
    assert len(forward.calls) == 1 and len(backward.calls) == 2
    monkeypatch.setattr(triton_compile, "SLOW_COMPILE_SECONDS", -1.0)  # a real compile: a warning, so users see it
    with caplog.at_level(logging.INFO, logger="hf_mixers.kernels"):
        assert triton_compile.compile_side_by_side("test read", ("layout", 2), lambda: warmups[:1])  # another layout
    assert len(forward.calls) == 2
    assert caplog.records[-1].levelno == logging.WARNING and "1 Triton kernels ready" in caplog.records[-1].message


def test_a_compile_error_reaches_the_caller_and_the_layout_stays_undone(monkeypatch):
    monkeypatch.setattr(triton_compile, "_DONE", set())

    class Broken:
        def warmup(self, *args, grid, **constexprs):
            raise RuntimeError("out of resources: shared memory")

    with pytest.raises(RuntimeError, match="shared memory"):
        triton_compile.compile_side_by_side("test read", "layout", lambda: [(Broken(), (1,), (), {})])
    assert "layout" not in triton_compile._DONE
    assert _async_compile.active_mode.get() is None


def test_without_async_compile_or_when_switched_off_nothing_is_compiled_ahead(monkeypatch):
    monkeypatch.setattr(triton_compile, "_DONE", set())
    kernel = FakeKernel()
    monkeypatch.setenv("HF_MIXERS_COMPILE_SIDE_BY_SIDE", "0")
    assert not triton_compile.compile_side_by_side("test read", "layout", lambda: [(kernel, (1,), (), {})])
    monkeypatch.delenv("HF_MIXERS_COMPILE_SIDE_BY_SIDE")
    monkeypatch.setattr(triton_compile, "AsyncCompileMode", None)  # Triton < 3.4
    assert not triton_compile.compile_side_by_side("test read", "layout", lambda: [(kernel, (1,), (), {})])
    assert kernel.calls == []
