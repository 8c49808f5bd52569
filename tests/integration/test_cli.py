"""The command line: the demo (its whole path on a tiny teacher; SmolLM2 runs marked slow), argument errors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import compile_decode_without_inductor

from hf_mixers.apps.bench import harness
from hf_mixers.apps.cli import build_parser, main


def test_demo_path_on_a_tiny_teacher(tmp_path, capsys, monkeypatch):
    """The demo's whole path (load, convert both mixers, stage 1 + 2, evaluate, sample, summary) in seconds; its
    compiled decode traced without Inductor's code (~20 s here; the contract compiles RSA's step with it)."""
    from conftest import save_tiny_teacher
    from hf_mixers.apps.demo import run_demo

    compile_decode_without_inductor(monkeypatch)
    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    summary = run_demo(str(tmp_path / "demo"), max_steps=2, teacher_source=teacher)
    assert set(summary["mixers"]) == {"rsa", "sessa"}
    rsa, sessa = summary["mixers"]["rsa"], summary["mixers"]["sessa"]
    # RSA with its 64-token window, stage 2 only (docs/benchmarks.md); Sessa is exact at init: nothing to transfer
    assert rsa["options"] == {"rsa_window": 64} and set(rsa["evaluations"]) == {"init", "stage2"}
    assert rsa["stages"]["stage2"]["steps"] == 2 and len(rsa["wider_evaluations"]) == 3
    assert set(sessa["evaluations"]) == {"init", "stage2"}
    assert sessa["evaluations"]["init"]["kl_teacher_student"] < 1e-8
    for name in ("summary.json", "summary.md", "loss_curves.png", "rsa/model/model.safetensors",
                 "rsa/conversion_report.json", "sessa/model/config.json"):
        assert (tmp_path / "demo" / name).exists(), name
    out = capsys.readouterr().out
    assert "| rsa (rsa_window=64) | stage2 | 2 |" in out and "Beyond the training text" in out
    assert "Decode tokens/s after a 512-token prompt, batch 1: teacher " in out and "sessa " in out
    assert rsa["decode"]["tokens_per_s"] > 0 and summary["teacher_decode"]["cache_mib"] > 0
    # as saved (eager) and as a server would run it (the compiled token step)
    assert rsa["decode_compiled"]["tokens_per_s"] > 0 and re.search(r"rsa \(rsa_window=64\) [\d.]+ \([\d.]+x\) "
                                                                     r"eager, [\d.]+ \([\d.]+x\) compiled", out)


@pytest.mark.slow
def test_demo_smoke_run_on_smollm2(tmp_path):
    main(["demo", "--out", str(tmp_path / "demo"), "--max-steps", "1"])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["mixers"]["sessa"]["evaluations"]["init"]["kl_teacher_student"] < 1e-6
    assert summary["mixers"]["rsa"]["stages"]["stage2"]["steps"] == 1


def test_demo_refuses_a_non_empty_output_folder_or_one_under_a_file_in_one_line(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path), "--max-steps", "1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-mixers demo: error: ") and "--overwrite" in error and len(error.splitlines()) == 1
    assert main(["demo", "--out", str(tmp_path / "precious.txt" / "demo"), "--max-steps", "1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-mixers demo: error: ") and len(error.splitlines()) == 1
    assert os.listdir(tmp_path) == ["precious.txt"]


def test_version_and_help_answer_without_loading_torch():
    code = ("import sys\nfrom hf_mixers.apps.cli import main\n"
            "for argv in (['--version'], ['--help'], ['push', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as done:\n        assert done.code == 0, argv\n"
            "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("hf-mixers 0.1.0\n") and "Exit codes: 0 done, 2 usage" in result.stdout


def test_distill_and_finetune_take_out_and_overwrite_like_every_command(monkeypatch, tmp_path):
    import hf_mixers.recipes as recipes

    seen = []
    for command in ("distill", "finetune"):
        monkeypatch.setattr(recipes, command, lambda recipe: seen.append(recipe) or {})
        assert main([command, "--out", str(tmp_path / "run é"), "--overwrite"]) == 0
        assert main([command, "--out", str(tmp_path / "a"), "--set", f"output.dir={tmp_path / 'b'}"]) == 0  # --set wins
    assert [(recipe.output.dir, recipe.output.overwrite) for recipe in seen] == \
        [(str(tmp_path / "run é"), True), (str(tmp_path / "b"), False)] * 2


def test_bad_arguments_are_reported_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sessa", "--lengths", "512,abc"])
    assert "expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nothing"])
    assert ("argument TARGET: invalid choice: 'nothing' (choose from 'decode', 'distill', 'generate', 'gltm', "
            "'kernels', 'precision', 'rsa'") in capsys.readouterr().err


def test_every_benchmark_has_its_own_flags_and_help(capsys):
    from hf_mixers.apps.bench import targets

    assert {"sessa", "rsa", "selective_ssm", "gltm", "vort", "distill", "kernels", "generate", "precision",
            "serve"} <= set(targets())
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listed = " ".join(capsys.readouterr().out.split())
    assert "distill, generate, gltm, kernels, precision, rsa, selective_ssm, serve, sessa, vort" in listed
    with pytest.raises(SystemExit):
        main(["bench", "gltm", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-mixers bench gltm") and "--patterns" in out and "--decode-batch" not in out


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


def test_no_command_replaces_earlier_results_without_overwrite(tmp_path, capsys, monkeypatch):
    """One policy: --out names the folder; a command that finds its own earlier results there refuses (one line,
    exit 2, before any work) unless --overwrite."""
    monkeypatch.setattr(harness, "cpu_peak_supported", lambda: False)  # no fresh process per point (~7 s each)
    bench = ["bench", "sessa", "--out", str(tmp_path), "--lengths", "16", "--hidden-size", "32", "--heads", "2",
             "--kv-heads", "1", "--repeats", "1"]
    assert main(bench) == 0
    before = (tmp_path / "bench_sessa.json").read_text()
    assert main(bench) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'bench_sessa.json'} exists (an earlier run's); pass --overwrite" in error
    assert (tmp_path / "bench_sessa.json").read_text() == before
    assert main([*bench, "--overwrite"]) == 0
    for argv in (["diagnose", "vort"], ["reproduce", "sessa-tail"], ["eval", str(tmp_path)]):
        (tmp_path / {"diagnose": "diagnose.json", "reproduce": "sessa-tail.json",
                     "eval": "eval_report.json"}[argv[0]]).write_text("{}")
        assert main([*argv, *(["--out", str(tmp_path)] if argv[0] != "eval" else [])]) == 2, argv
        assert "exists (an earlier run's); pass --overwrite" in capsys.readouterr().err


def test_bench_rejects_inconsistent_shapes_and_a_missing_gpu_in_one_line(tmp_path, capsys):
    code = main(["bench", "sessa", "--out", str(tmp_path), "--hidden-size", "32", "--heads", "5", "--kv-heads", "1"])
    assert code == 2
    assert "hf-mixers bench sessa: error: --heads (5) must divide --hidden-size (32)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "rsa", "--out", str(tmp_path), "--device", "cuda"]) == 2
        assert "hf-mixers bench rsa: error: --device cuda asked for, but torch sees no CUDA" in capsys.readouterr().err


@pytest.mark.slow
def test_full_default_demo_learns(tmp_path):
    main(["demo", "--out", str(tmp_path / "demo")])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    rsa, sessa = summary["mixers"]["rsa"]["evaluations"], summary["mixers"]["sessa"]["evaluations"]
    assert rsa["stage2"]["kl_teacher_student"] < 0.7 * rsa["init"]["kl_teacher_student"]
    assert sessa["stage2"]["student_perplexity"] <= 1.01 * sessa["stage2"]["teacher_perplexity"]


def test_bench_rsa_writes_training_and_decoding_results(tmp_path, monkeypatch):
    """Each point's peak memory in a fresh process (the harness's; the other benches' tests turn it off), the
    compiled decode row traced without Inductor's code (~25 s here; the contract compiles RSA's step with it)."""
    compile_decode_without_inductor(monkeypatch)
    main(["bench", "rsa", "--out", str(tmp_path), "--lengths", "64", "--contexts", "16,48", "--hidden-size", "32",
          "--heads", "2", "--kv-heads", "1", "--repeats", "1", "--decode-tokens", "2", "--decode-batch", "2"])
    report = json.loads((tmp_path / "bench_rsa.json").read_text())
    assert report["shape"]["decode_batch"] == 2
    assert (tmp_path / "bench_rsa.png").stat().st_size > 10_000
    assert {r["mixer"] for r in report["training"]} == {"sdpa_attention", "rsa_chunked", "rsa_recompute"}
    rsa_bytes = [r["cache_bytes"] for r in report["decoding"] if r["model"] == "rsa"]
    attention_bytes = [r["cache_bytes"] for r in report["decoding"] if r["model"] == "attention"]
    assert rsa_bytes[0] == rsa_bytes[1] and attention_bytes[1] > attention_bytes[0]  # constant vs growing cache
    # K and V of 2 layers x 2 rows x 16 tokens x 1 KV head x head_dim 16 in fp32
    assert attention_bytes[0] == 2 * 2 * 2 * 16 * 16 * 4
    assert {r["model"] for r in report["decoding"]} == {"rsa", "rsa_compiled", "attention"}
    assert report["targets"]["cache_bytes_constant"] and report["targets"]["decode_speedup_met"] is None


def test_bench_decode_loads_folders_as_users_do_in_fresh_processes(tmp_path, teacher_dir):
    """Each folder in two fresh processes (the first on an emptied compiled-steps cache), loaded through its remote
    code beside the teacher, timed through plain generate: its default compile_decode recorded, ms a token against
    the teacher's at each context, eager ms a token in the later process; JSON and plot."""
    folder = tmp_path / "rsa"
    assert main(["convert", teacher_dir, "--mixer", "rsa", "--out", str(folder)]) == 0
    # ms a token is (t(N) - t(1)) / (N - 1): N = 12 keeps that difference well above one timing's jitter (at N = 4 a
    # loaded machine once took it to zero)
    main(["bench", "decode", str(folder), "--teacher", teacher_dir, "--contexts", "8,16", "--new-tokens", "2,12",
          "--repeats", "1", "--out", str(tmp_path / "bench")])
    report = json.loads((tmp_path / "bench" / "bench_decode.json").read_text())
    assert [(row["model"], row["process"]) for row in report["rows"]] == [("rsa", "cold"), ("rsa", "warm")]
    cold, warm = report["rows"]
    assert cold["compile_decode"] == "auto" and [p["context"] for p in cold["points"]] == [8]
    assert [p["context"] for p in warm["points"]] == [8, 16] and all(
        p["model_ms_per_token"] > 0 and p["ratio"] > 0 and p["eager_ms_per_token"] > 0 for p in warm["points"])
    assert (tmp_path / "bench" / "bench_decode.png").stat().st_size > 10_000


def test_bench_selective_ssm_writes_training_scan_forms_and_decoding(tmp_path):
    main(["bench", "selective_ssm", "--out", str(tmp_path), "--lengths", "64", "--contexts", "16,48",
          "--hidden-size", "32", "--heads", "2", "--kv-heads", "1", "--repeats", "1", "--decode-tokens", "2",
          "--variants", "mamba2,s6"])
    report = json.loads((tmp_path / "bench_selective_ssm.json").read_text())
    assert (tmp_path / "bench_selective_ssm.png").stat().st_size > 10_000
    assert {r["mixer"] for r in report["training"]} == {"sdpa_attention", "selective_ssm:mamba2", "selective_ssm:s6"}
    assert {(r["T"], r["decay"]) for r in report["scan_forms"]} >= {(512, "mamba2"), (2048, "s6 / s4d")}
    assert report["targets"]["cache_bytes_constant"] == {"mamba2": True, "s6": True}
    attention_bytes = [r["cache_bytes"] for r in report["decoding"] if r["model"] == "attention"]
    assert attention_bytes[1] > attention_bytes[0] and report["targets"]["decode_speedup_met"] is None
    assert main(["bench", "selective_ssm", "--out", str(tmp_path / "bad"), "--variants", "mamba"]) == 2


def test_bench_gltm_writes_training_decoding_and_the_pow2_ce_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "cpu_peak_supported", lambda: False)  # no fresh process per point for its peak
    main(["bench", "gltm", "--out", str(tmp_path), "--lengths", "32,64", "--contexts", "16,48", "--hidden-size", "32",
          "--heads", "2", "--kv-heads", "1", "--repeats", "1", "--decode-tokens", "2", "--variants", "pow2_ce,dense"])
    report = json.loads((tmp_path / "bench_gltm.json").read_text())
    assert (tmp_path / "bench_gltm.png").stat().st_size > 10_000
    assert {r["mixer"] for r in report["training"]} == {"sdpa_attention", "gltm:pow2_ce", "gltm:dense"}
    cache = report["targets"]["cache_bytes"]
    assert cache["pow2_ce"]["48"] < cache["dense"]["48"] and cache["attention"]["48"] > cache["attention"]["16"]
    assert report["targets"]["pow2_ce_cache_vs_kv"] < 1 and isinstance(report["targets"]["pow2_ce_time_met"], bool)
    assert main(["bench", "gltm", "--out", str(tmp_path / "bad"), "--variants", "pow3"]) == 2


def test_bench_vort_writes_training_decoding_and_its_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "cpu_peak_supported", lambda: False)  # memory (test_bench_sessa measures it)
    main(["bench", "vort", "--out", str(tmp_path), "--lengths", "32,64", "--contexts", "16,80", "--hidden-size", "32",
          "--heads", "2", "--kv-heads", "1", "--repeats", "1", "--decode-tokens", "2", "--variants", "exp"])
    report = json.loads((tmp_path / "bench_vort.json").read_text())
    assert (tmp_path / "bench_vort.png").stat().st_size > 10_000
    assert {r["mixer"] for r in report["training"]} == {"sdpa_attention", "vort:exp"}
    cache, targets = report["targets"]["cache_bytes"], report["targets"]
    assert cache["vort"]["16"] == cache["vort"]["80"] and targets["cache_constant"] is True  # window 64 + state
    assert cache["attention"]["80"] > cache["attention"]["16"]
    assert isinstance(targets["time_met"], bool) and targets["decode_speedup_vs_attention"] > 0
    assert main(["bench", "vort", "--out", str(tmp_path / "bad"), "--variants", "power"]) == 2


def test_bench_distill_writes_the_ratio(tmp_path, monkeypatch):
    """Both steps eager, then with every block compiled (traced here without Inductor's C++ build): both ratios."""
    from conftest import save_tiny_teacher
    from hf_mixers.recipes import stages

    monkeypatch.setattr(stages, "COMPILE_BACKEND", "aot_eager_decomp_partition")
    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    assert main(["bench", "distill", "--out", str(tmp_path / "bench"), "--source", teacher, "--mixer", "sessa",
                 "--sequence-length", "32", "--repeats", "1", "--option", "sessa_feedback_dim=16",
                 "--compile", "true"]) == 0
    report = json.loads((tmp_path / "bench" / "bench_distill.json").read_text())
    assert report["mixer_options"] == {"sessa_feedback_dim": 16}  # --option: the student's mixer options
    assert set(report["tokens_per_s"]) == {"distill", "baseline_lora", "distill_compiled", "baseline_lora_compiled"}
    assert report["ratio"] > 0 and report["ratio_compiled"] > 0 and report["compile"] == "default"
    assert report["target"] == 0.6 and isinstance(report["target_met"], bool)
    assert main(["bench", "distill", "--out", str(tmp_path / "bad"), "--compile", "fast"]) == 2
    assert report["dtype"] == "float32" and report["device"]  # the GPU when there is one, else "cpu"


def test_bench_generate_measures_models_against_their_teacher(tmp_path):
    """bench generate: a saved converted model and one converted in the run, against the teacher at every batch and
    context; ratios to the teacher's point, the largest batch in the budget, the generate timing, the table."""
    from conftest import save_tiny_teacher

    from hf_mixers.conversion import convert

    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    convert(teacher, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, out=str(tmp_path / "rsa"),
            progress=False)
    assert main(["bench", "generate", str(tmp_path / "rsa"), "--teacher", teacher, "--mixer", "gltm",
                 "--out", str(tmp_path / "bench"), "--batch-sizes", "1,2", "--contexts", "16,64", "--decode-tokens",
                 "2", "--prompt-tokens", "8", "--generate-tokens", "3", "--memory-budget-gib", "0.01",
                 "--repeats", "1", "--budget-decode-steps", "1", "--budget-batch-cap", "3"]) == 0
    report = json.loads((tmp_path / "bench" / "bench_generate.json").read_text())
    assert report["models"] == ["teacher", "rsa", "gltm"] and len(report["rows"]) == 3 * 2 * 2
    for row in report["rows"]:
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["cache_bytes"] > 0
        assert row["max_batch_in_budget"] >= 0
        assert row["decode_s_per_step_repeats"] == [row["decode_s_per_step"]]  # one repeat: the row's own figure
        if row["model"] == "teacher":
            assert row["decode_speedup_vs_teacher"] == 1.0
    teacher_cache = {r["context"]: r["cache_bytes"] for r in report["rows"] if r["model"] == "teacher" and
                     r["batch"] == 1}
    assert teacher_cache[64] > teacher_cache[16]  # attention's cache grows with the context
    assert set(report["generate"]["seconds"]) == {"teacher", "rsa", "gltm"}
    assert report["generate"]["speedup_vs_teacher"]["teacher"] == 1.0
    at_budget = [row for row in report["rows"] if "budget_batch" in row]  # batch-1 rows whose model fits the budget
    assert at_budget and all(row["batch"] == 1 and 1 <= row["budget_batch"] <= min(3, row["max_batch_in_budget"])
                             and row["budget_decode_tokens_per_s"] > 0 for row in at_budget)
    table = (tmp_path / "bench" / "bench_generate.md").read_text()
    assert table.count("\n| rsa | ") == 4 + sum(row["model"] == "rsa" for row in at_budget)  # + the budget table
    assert "Decode at the largest batch within the budget (capped at 3" in table
    assert "generate, 3 new tokens after a 8-token prompt" in table
    assert (tmp_path / "bench" / "bench_generate.png").exists()
    assert not (tmp_path / "bench" / "bench_generate.partial.json").exists()  # written per point, then replaced
    assert main(["bench", "generate", "--teacher", teacher, "--out", str(tmp_path / "none")]) == 2  # no model named
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "generate", "--mixer", "rsa", "--memory-budget-gib", "0"])
    assert exit_info.value.code == 2


def test_bench_generate_starts_each_repeat_from_the_next_model_and_keeps_the_fastest(tmp_path, monkeypatch):
    """--repeats: at each (batch, context) the models' repeats interleave, each repeat from the next model (the
    model timed right after the teacher measured a few % ahead on a CPU), and a row keeps its fastest repeat."""
    from conftest import save_tiny_teacher

    from hf_mixers.apps.bench.generate import bench_generate
    from hf_mixers.common import measures

    calls = []

    def timing(model, context, decode_tokens, vocab, device, warmup=3, batch=1, keep_cache=False):
        label = "teacher" if model.config.model_type == "llama" else "student"
        calls.append((batch, context, label))
        seconds = 0.5 if sum(call == calls[-1] for call in calls) == 2 else 1.0  # each model's 2nd repeat faster
        return {"prefill_s": seconds, "decode_s": seconds / 10, "cache_bytes": 64, "cache_used_bytes": 64}

    monkeypatch.setattr(measures, "generation_timing", timing)
    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    report = bench_generate(str(tmp_path / "bench"), teacher=teacher, mixers=["gltm"], batch_sizes=(1,),
                            contexts=(8, 16), decode_tokens=2, prompt_tokens=4, generate_tokens=1, repeats=3)
    timed = [call for call in calls if call[1] in (8, 16)]  # not convert's cache probes (64, 128, 256 tokens)
    assert [label for _, _, label in timed] == ["teacher", "student", "student", "teacher", "teacher", "student"] * 2
    assert [call[1] for call in timed] == [8] * 6 + [16] * 6
    assert all(row["prefill_s"] == 0.5 and row["decode_s_per_step"] == 0.05 for row in report["rows"])


def test_bench_generate_pairs_each_repeat_with_the_teachers_round(tmp_path, monkeypatch):
    """With --repeats the decode ratio is also paired: the median of each round's teacher step over the model's, what a
    machine whose speed drifts between rounds leaves intact (the fastest repeats may come from different phases); the
    table shows it beside the fastest repeats' ratio."""
    from conftest import save_tiny_teacher

    from hf_mixers.apps.bench.generate import bench_generate
    from hf_mixers.common import measures

    steps = {"teacher": iter([1.0, 2.0, 2.0]), "student": iter([2.2, 2.2, 2.2])}  # the teacher's first round fast

    def timing(model, context, decode_tokens, vocab, device, warmup=3, batch=1, keep_cache=False):
        if context != 8:  # convert's cache probes
            return {"prefill_s": 1.0, "decode_s": 1.0, "cache_bytes": 64, "cache_used_bytes": 64}
        seconds = next(steps["teacher" if model.config.model_type == "llama" else "student"])
        return {"prefill_s": 1.0, "decode_s": seconds, "cache_bytes": 64, "cache_used_bytes": 64}

    monkeypatch.setattr(measures, "generation_timing", timing)
    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    report = bench_generate(str(tmp_path / "bench"), teacher=teacher, mixers=["gltm"], batch_sizes=(1,),
                            contexts=(8,), decode_tokens=2, prompt_tokens=4, generate_tokens=1, repeats=3)
    student = next(row for row in report["rows"] if row["model"] != "teacher")
    assert student["decode_s_per_step_repeats"] == [2.2, 2.2, 2.2]
    assert student["decode_speedup_vs_teacher"] == pytest.approx(1.0 / 2.2)  # the fastest repeats: 1.0 against 2.2
    assert student["decode_speedup_vs_teacher_paired"] == pytest.approx(2.0 / 2.2)  # the median of 1/2.2, 2/2.2, 2/2.2
    table = (tmp_path / "bench" / "bench_generate.md").read_text()
    assert "| x teacher, paired |" in table and "| 0.45 | 0.91 |" in table


def test_bench_generate_keeps_two_model_folders_of_the_same_name_apart(tmp_path):
    """Distilled models all live in OUT/model: two such folders are both measured, the second under its path."""
    import torch
    from conftest import save_tiny_teacher

    from hf_mixers.apps.bench.generate import _models
    from hf_mixers.conversion import convert

    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    for run in ("a", "b"):
        convert(teacher, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2},
                out=str(tmp_path / run / "model"), progress=False)
    models, _ = _models(teacher, [str(tmp_path / "a" / "model"), str(tmp_path / "b" / "model")], [], {},
                        torch.float32, torch.device("cpu"))
    assert list(models) == ["teacher", "model", str(tmp_path / "b" / "model")]
    # --compile-decode MODE: the converted models decode through their compiled step, the teacher stays eager
    models, _ = _models(teacher, [str(tmp_path / "a" / "model")], [], {}, torch.float32, torch.device("cpu"),
                        compile_decode="reduce-overhead")
    assert list(models) == ["teacher", "model, compiled decode (reduce-overhead)"]
    assert models["model, compiled decode (reduce-overhead)"].config.compile_decode == "reduce-overhead"
    assert not hasattr(models["teacher"].config, "compile_decode")
    assert main(["bench", "generate", str(tmp_path / "a" / "model"), "--teacher", teacher, "--compile-decode",
                 "fast", "--out", str(tmp_path / "bench")]) == 2


def test_bench_kernels_on_cpu_compares_the_pytorch_paths_only(tmp_path, monkeypatch):
    """On CPU the Triton kernels are not timed (the interpreter is no benchmark); the report says why."""
    assert main(["bench", "kernels", "--out", str(tmp_path), "--lengths", "32,64", "--shapes", "smollm2-135m",
                 "--repeats", "1"]) == 0
    report = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert {(r["T"], r["candidate"]) for r in report["results"]} == {
        (t, c) for t in (32, 64) for c in ("sdpa", "sessa_torch", "rsa_torch")}
    assert all(r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0 and r["peak_bytes"] is None for r in report["results"])
    assert report["triton"].startswith("tensors on cpu") and (tmp_path / "bench_kernels.png").exists()
    assert all(r["torch_fwd_bwd_vs_sdpa"] > 0 and r["rsa_torch_fwd_bwd_vs_sdpa"] > 0 and r["triton_speedup_fwd"] is None
               and r["rsa_triton_speedup_fwd_bwd"] is None for r in report["ratios"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from hf_mixers.apps.bench.kernels import bench_kernels

    report = bench_kernels(str(tmp_path), lengths=[32], shapes=["smollm2-135m"], repeats=1)
    assert report["triton"] == "TRITON_INTERPRET=1: the interpreter is no benchmark"
    with pytest.raises(ValueError, match="unknown shape"):
        bench_kernels(str(tmp_path), shapes=["gpt5"])


def test_bench_kernels_cuts_a_candidate_whose_next_length_would_pass_the_limit(tmp_path, monkeypatch):
    """The next T costs at least proportionally more: 0.6 s at T = 32 is 1.2 s at 64, past a 1 s limit (not made),
    within a 1.5 s one (made)."""
    from hf_mixers.apps.bench import kernels

    monkeypatch.setattr(kernels, "time_calls", lambda calls, repeats, device: [(0.6, 0.6)] * len(calls))
    for limit, measured in ((1.0, {32}), (1.5, {32, 64})):
        report = kernels.bench_kernels(str(tmp_path / str(limit)), lengths=[32, 64], shapes=["smollm2-135m"],
                                       repeats=1, max_call_seconds=limit)
        assert {r["T"] for r in report["results"] if r["candidate"] == "rsa_torch"} == measured, limit


def test_bench_kernels_cuts_slow_candidates_and_keeps_the_points_of_a_stopped_run(tmp_path, monkeypatch):
    """A candidate past --max-call-seconds at one T is not run at the longer ones (and the report says so); each
    point is written as it ends, so a run stopped at a later point leaves the earlier ones (the GPU check's steps run
    under time limits)."""
    from hf_mixers.apps.bench import kernels

    report = kernels.bench_kernels(str(tmp_path), lengths=[64, 32], shapes=["smollm2-135m"], repeats=1,
                                   max_call_seconds=1e-9)
    assert {(r["T"], r["candidate"]) for r in report["results"]} == {(32, c) for c in ("sdpa", "sessa_torch",
                                                                                       "rsa_torch")}
    assert set(report["cut"]["smollm2-135m"]) == {"sdpa", "sessa_torch", "rsa_torch"}
    assert "not run past T=32" in report["cut"]["smollm2-135m"]["rsa_torch"]
    assert all(r["torch_fwd_bwd_vs_sdpa"] is None for r in report["ratios"] if r["T"] == 64)
    assert not (tmp_path / "bench_kernels.partial.json").exists()  # the whole report replaced it

    timed, real = [], kernels.time_calls

    def stop_at_the_second_point(calls, repeats, device):
        timed.append(len(calls))
        if len(timed) > 2:  # the forward and the forward+backward of the first point ran
            raise KeyboardInterrupt
        return real(calls, repeats, device)

    monkeypatch.setattr(kernels, "time_calls", stop_at_the_second_point)
    with pytest.raises(KeyboardInterrupt):
        kernels.bench_kernels(str(tmp_path / "stopped"), lengths=[32, 64], shapes=["smollm2-135m"], repeats=1)
    partial = json.loads((tmp_path / "stopped" / "bench_kernels.partial.json").read_text())
    assert partial["complete"] is False and {(r["T"], r["candidate"]) for r in partial["rows"]} == {
        (32, c) for c in ("sdpa", "sessa_torch", "rsa_torch")}
    assert not (tmp_path / "stopped" / "bench_kernels.json").exists()


def test_bench_generate_reports_what_a_compiled_step_took_to_build(tmp_path, monkeypatch):
    """--compile-decode: the warm-up that builds each converted model's compiled step is timed per batch size (what
    a process's first `generate` waits), in the JSON and the table. dynamo's eager backend stands in for Inductor."""
    import torch
    from conftest import save_tiny_teacher

    from hf_mixers.apps.bench.generate import bench_generate
    from hf_mixers.decode import engine

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, mode=None, options=None, **kwargs:
                        compile_(function, backend="eager", **kwargs))
    monkeypatch.setattr(engine, "_compiled_steps", {})
    teacher = str(tmp_path / "teacher")
    save_tiny_teacher(teacher)
    report = bench_generate(str(tmp_path / "bench"), teacher=teacher, mixers=["selective_ssm"], batch_sizes=(1, 2),
                            contexts=(16,), decode_tokens=2, prompt_tokens=8, generate_tokens=2, compile_decode=True)
    label = "selective_ssm, compiled decode"
    assert report["models"] == ["teacher", label]
    assert set(report["compile_seconds"]) == {label} and set(report["compile_seconds"][label]) == {"1", "2"}
    assert all(seconds > 0 for seconds in report["compile_seconds"][label].values())
    table = (tmp_path / "bench" / "bench_generate.md").read_text()
    assert "compiled token steps built (the first decode at each batch size" in table and \
        f"{label} at batch 2 " in table
    assert json.loads((tmp_path / "bench" / "bench_generate.json").read_text())["compile_seconds"] == \
        report["compile_seconds"]
