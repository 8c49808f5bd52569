"""kernels/dispatch.py: which path runs, why, said once; the config field and the environment variable force it."""

import logging

import pytest
import torch

from hf_mixers import SessaConfig
from hf_mixers.kernels import dispatch

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(dispatch, "_announced", set())
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_on_cpu_takes_the_pytorch_path_and_says_why_once(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        assert dispatch.use_triton("Sessa feedback solve", CPU) is False
        assert dispatch.use_triton("Sessa feedback solve", CPU) is False
    assert len(caplog.records) == 1
    assert "Sessa feedback solve runs on the PyTorch path (tensors on cpu (the kernels need CUDA" in caplog.text


def test_the_interpreter_runs_kernels_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.triton_unavailable(CPU) is None
    assert dispatch.use_triton("k", CPU) is True
    # an option the kernel does not cover sends "auto" back to PyTorch, and fails a forced "triton"
    assert dispatch.use_triton("k", CPU, check=lambda: "rsa_decay is not fused") is False
    with pytest.raises(RuntimeError, match=r"k: the Triton kernel was requested \(kernel_backend='triton'\) but "
                                           r"cannot run: rsa_decay is not fused"):
        dispatch.use_triton("k", CPU, "triton", check=lambda: "rsa_decay is not fused")


def test_forcing_either_path(monkeypatch, caplog):
    with pytest.raises(RuntimeError, match=r"requested \(kernel_backend='triton'\) but cannot run: tensors on cpu"):
        dispatch.use_triton("k", CPU, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")  # the environment wins over the config field
        assert dispatch.use_triton("k", CPU, "triton") is False
    assert "k runs on the PyTorch path (forced by HF_MIXERS_BACKEND=torch)" in caplog.text
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="HF_MIXERS_BACKEND=cuda: unknown kernel backend; choose one of auto, "
                                         "triton, torch"):
        dispatch.use_triton("k", CPU)


def test_missing_triton_is_the_reason_and_the_options_are_not_asked(monkeypatch):
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: None)
    assert dispatch.triton_unavailable(torch.device("cuda")) == "triton is not installed (pip install triton)"

    def check():  # would import the kernel module, which needs triton
        raise AssertionError("asked although triton cannot run")

    assert dispatch.use_triton("k", torch.device("cuda"), check=check) is False


def test_config_field_is_validated():
    assert SessaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2).kernel_backend == "auto"
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        SessaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, kernel_backend="fast")


def test_a_sessa_model_on_cpu_runs_the_pytorch_path_by_default(caplog):
    from conftest import tiny_sessa_model

    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        tiny_sessa_model()(torch.randint(1, 101, (1, 8)))
    assert "Sessa feedback solve runs on the PyTorch path (tensors on cpu" in caplog.text


def test_a_path_measured_faster_is_taken_under_auto_only(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        assert dispatch.use_triton("k", CPU, slower=lambda: "faster at this size") is False
        assert dispatch.use_triton("k", CPU, "triton", slower=lambda: "faster at this size") is True
        assert dispatch.use_triton("k", CPU, slower=lambda: None) is True
    assert "k runs on the PyTorch path (faster at this size)" in caplog.text


def test_a_decision_inside_torch_compile_does_not_break_the_graph(caplog):
    """A compiled step's first call may be the first to ask: the log line is left out there (a logging call would
    end dynamo's graph), and said by the next eager call."""

    def step(x):
        return x * 2 if dispatch.use_triton("Sessa feedback solve", x.device) else x + 1

    with caplog.at_level(logging.WARNING, logger="hf_mixers.kernels"):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
        assert not caplog.records
        step(torch.ones(2))
    assert "Sessa feedback solve runs on the PyTorch path" in caplog.text
