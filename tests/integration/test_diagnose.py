"""Lag sensitivity (common/lag_sensitivity.py, `hf-mixers diagnose`): exact on maps whose Jacobian is known in
closed form (Sessa's uniform-routing solve, attention with uniform routing), tail fits that recover a known law,
and the command on a mixer name and on a model folder."""

import json
import math

import pytest
import torch

from hf_mixers.apps.cli import main
from hf_mixers.common.lag_sensitivity import fit_tail, lag_grid, lag_sensitivity, sessa_uniform_kernel
from hf_mixers.testing import tiny_model


def test_sessa_uniform_routing_kernel_is_measured_exactly():
    """y = (I - gamma A)^-1 x with A_{t,j} = 1/t (j < t): the Jacobian block is K_{t,s} I, the closed form."""
    gamma, length = 0.7, 200
    t = torch.arange(length, dtype=torch.float64)
    routing = torch.tril(torch.ones(length, length, dtype=torch.float64), -1) / t.clamp(min=1)[:, None]
    solve = torch.linalg.inv(torch.eye(length, dtype=torch.float64) - gamma * routing)
    x = torch.randn(1, length, 6, dtype=torch.float64)
    for source in (0, 3):
        gains = lag_sensitivity(lambda inputs: torch.einsum("ts,bsd->btd", solve, inputs), x, source=source,
                                probes=3)
        expected = sessa_uniform_kernel(gamma, source, list(gains))
        assert list(gains.values()) == pytest.approx(expected, rel=1e-10)
    fit = fit_tail(lag_sensitivity(lambda inputs: torch.einsum("ts,bsd->btd", solve, inputs), x))
    assert fit["power"]["exponent"] == pytest.approx(-(1 - gamma), abs=0.02) and fit["better"] == "power"


def test_attention_with_uniform_routing_decays_as_one_over_t():
    """q = 0: every query attends uniformly, y_t = O V mean_{j<=t} x_j, so the gain is ||O V||_F / sqrt(D) / (t+1)."""
    model = tiny_model("full_attention")
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        mixer.q_proj.weight.zero_()
        if mixer.q_proj.bias is not None:
            mixer.q_proj.bias.zero_()
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    rope = model.model.rotary_emb(x, torch.arange(40)[None])
    gains = lag_sensitivity(lambda h: mixer(h, tuple(r.expand(h.shape[0], -1, -1) for r in rope)), x, probes=4)
    stacked = torch.cat([mixer.v_proj.weight.view(2, 8, 32)[h // 2] for h in range(4)])  # (H d, D): V of each head
    norm = (mixer.o_proj.weight @ stacked).norm().item() / math.sqrt(32)  # J_{t,0} = O V / (t + 1)
    scaled = [gain * (lag + 1) for lag, gain in gains.items()]  # the probes are shared: one constant for every lag
    assert max(scaled) == pytest.approx(min(scaled), rel=1e-10)
    assert scaled[0] == pytest.approx(norm, rel=0.35)  # the 4-probe estimate of ||J||_F / sqrt(D)


def test_fits_recover_power_laws_and_exponentials():
    lags = lag_grid(1000)
    assert lags[0] == 1 and lags[-1] == 1000 and lags == sorted(set(lags))
    power = fit_tail({lag: 3.0 * lag ** -0.4 for lag in lags})
    assert power["power"]["exponent"] == pytest.approx(-0.4, abs=1e-9) and power["better"] == "power"
    exponential = fit_tail({lag: 2.0 * math.exp(-0.01 * lag) for lag in lags})
    assert exponential["exponential"]["rate"] == pytest.approx(0.01, rel=1e-9)
    assert exponential["better"] == "exponential"


def test_diagnose_command_on_a_mixer_and_on_a_model_folder(tmp_path, capsys):
    from conftest import tiny_tokenizer

    assert main(["diagnose", "vort", "--length", "48", "--hidden-size", "32", "--heads", "2", "--kv-heads", "1",
                 "--option", "window=8", "--out", str(tmp_path / "mixer")]) == 0
    report = json.loads((tmp_path / "mixer" / "diagnose.json").read_text())
    entry = report["entries"][0]
    assert report["protocol"].startswith("fixed source") and entry["kind"] == "vort"
    assert entry["theory"]["law"] == "power" and "power" in entry["fit"]
    assert (tmp_path / "mixer" / "diagnose.png").stat().st_size > 10_000

    tokenizer = tiny_tokenizer()
    model = tiny_model("hybrid", dtype=torch.float32, vocab_size=len(tokenizer))
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 17} and more" for i in range(200)))
    assert main(["diagnose", str(folder), "--length", "40", "--layers", "0,2", "--text", str(text), "--out",
                 str(tmp_path / "folder")]) == 0
    names = [e["name"] for e in json.loads((tmp_path / "folder" / "diagnose.json").read_text())["entries"]]
    kinds = model.config.layer_types
    assert names == [f"layer 0 ({kinds[0]})", f"layer 2 ({kinds[2]})", "whole model (embeddings -> last hidden state)"]
    capsys.readouterr()
    assert main(["diagnose", "no_such_mixer", "--out", str(tmp_path / "x")]) == 2
    assert "neither a model folder nor a registered mixer" in capsys.readouterr().err
    assert main(["diagnose", str(folder), "--layers", "99", "--text", str(text), "--length", "40",
                 "--out", str(tmp_path / "y")]) == 2
    capsys.readouterr()
    limit = model.config.max_position_embeddings
    assert main(["diagnose", str(folder), "--length", str(limit + 1), "--out", str(tmp_path / "z")]) == 2
    assert f"--length {limit + 1} is more than the model's max_position_embeddings ({limit})" in \
        capsys.readouterr().err


def test_diagnose_reads_only_the_start_of_a_large_text(tmp_path, monkeypatch):
    """--text: its first --length tokens are used, so only the start of the file is read (a few characters a
    token plus 64 KiB), not a corpus of gigabytes."""
    from hf_mixers.apps import cli
    from hf_mixers.apps import diagnose as module

    seen = {}

    def recording(*args, text=None, **kwargs):
        seen["characters"] = len(text)
        raise ValueError("diagnose: stopped by the test")

    monkeypatch.setattr(module, "diagnose", recording)
    big = tmp_path / "big.txt"
    big.write_text("word " * 400_000)
    assert main(["diagnose", "rsa", "--text", str(big), "--length", "40", "--out", str(tmp_path / "d")]) == 2
    assert seen["characters"] == cli.DIAGNOSE_CHARACTERS_PER_TOKEN * 40 + 2**16 < big.stat().st_size
