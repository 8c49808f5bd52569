"""The command line: the demo end to end (a smoke run of the same path), argument errors."""

import json
import os

import pytest

from hf_mixers.cli import build_parser, main


def test_demo_smoke_run(tmp_path, capsys):
    out = tmp_path / "demo"
    main(["demo", "--out", str(out), "--max-steps", "3"])
    report = json.loads((out / "demo_report.json").read_text())
    assert report["training"]["steps"] == 3
    assert report["generation"]["cached_equals_uncached"]
    reload = report["remote_code_reload"]
    assert reload["generated_tokens_identical"] and reload["max_abs_logit_difference"] == 0.0
    assert not reload["hf_mixers_imported_in_child"]
    assert "modeling_hf_mixers.py" in os.listdir(out / "model")
    assert "hf-mixers demo" in capsys.readouterr().out


def test_demo_refuses_a_non_empty_output_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="--overwrite"):
        main(["demo", "--out", str(tmp_path), "--max-steps", "1"])
    assert os.listdir(tmp_path) == ["precious.txt"]


def test_bad_arguments_are_reported_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "sessa", "--lengths", "512,abc"])
    assert "expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nothing"])


def test_bench_sessa_writes_json_and_plot(tmp_path):
    main(["bench", "sessa", "--out", str(tmp_path), "--lengths", "64", "--hidden-size", "32", "--heads", "2",
          "--kv-heads", "1", "--repeats", "1"])
    report = json.loads((tmp_path / "bench_sessa.json").read_text())
    assert (tmp_path / "bench_sessa.png").stat().st_size > 10_000
    assert {(r["T"], r["mixer"]) for r in report["results"]} == {
        (64, m) for m in ("sdpa_attention", "sessa_chunked", "sessa_dense")}
    assert all(r["fwd_bwd_s"] > 0 and r["peak_bytes"] is not None and r["peak_bytes"] >= 0 for r in report["results"])
    assert all(r["chunked_time_vs_sdpa"] > 0 for r in report["ratios"])
    assert report["targets"]["time_ratio_at_2048"] is None  # T = 2048 was not run


def test_bench_rejects_inconsistent_shapes(tmp_path):
    with pytest.raises(ValueError, match="--heads \\(5\\) must divide --hidden-size \\(32\\)"):
        main(["bench", "sessa", "--out", str(tmp_path), "--hidden-size", "32", "--heads", "5", "--kv-heads", "1"])


@pytest.mark.slow
def test_full_default_demo_learns(tmp_path):
    main(["demo", "--out", str(tmp_path / "demo")])
    report = json.loads((tmp_path / "demo" / "demo_report.json").read_text())
    assert report["held_out"]["loss_after_training"] < 0.5 * report["held_out"]["loss_at_init"]
    assert report["feedback_gain"]["mean_abs"] > 0.01  # the feedback loop was used, not left at gamma = 0
    assert report["remote_code_reload"]["generated_tokens_identical"]


def test_bench_rsa_writes_training_and_decoding_results(tmp_path):
    main(["bench", "rsa", "--out", str(tmp_path), "--lengths", "64", "--contexts", "16,48", "--hidden-size", "32",
          "--heads", "2", "--kv-heads", "1", "--repeats", "1", "--decode-tokens", "2"])
    report = json.loads((tmp_path / "bench_rsa.json").read_text())
    assert (tmp_path / "bench_rsa.png").stat().st_size > 10_000
    assert {r["mixer"] for r in report["training"]} == {"sdpa_attention", "rsa_chunked", "rsa_recompute"}
    rsa_bytes = [r["cache_bytes"] for r in report["decoding"] if r["model"] == "rsa"]
    attention_bytes = [r["cache_bytes"] for r in report["decoding"] if r["model"] == "attention"]
    assert rsa_bytes[0] == rsa_bytes[1] and attention_bytes[1] > attention_bytes[0]  # constant vs growing cache
    assert {r["model"] for r in report["decoding"]} == {"rsa", "rsa_compiled", "attention"}
    assert report["targets"]["cache_bytes_constant"] and report["targets"]["decode_speedup_met"] is None
