"""`make gpu-check` without CUDA is a dry run: the steps of scripts/gpu_check.py on CPU at tiny sizes (the CUDA tier
tests/gpu under the Triton interpreter, the benches, a three-step distillation; the few the suite runs elsewhere left
out), so that the script a GPU session runs at once cannot rot between the rare sessions that are lent one. CI runs
the steps whose code no other test runs (its `ci` group); `pytest -m slow` the whole dry run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS = ["compile-rsa-window-smollm2-135m", "teacher", "decode-graphs", "bench-generate-compiled", "bench-distill",
         "bench-distill-compiled-write", "bench-generate-compiled-others", "bench-kernels", "distill-30",
         "distill-30-compiled-write", "bench-generate", "pytest-mixers", "pytest-kernels", "pytest-libraries",
         "scale-8b"]  # the dry run's, in order


@pytest.mark.parametrize("only", [pytest.param(None, marks=pytest.mark.slow), "ci"])
def test_gpu_check_dry_run_passes_every_step_and_writes_its_figures(tmp_path, only):
    """The whole dry run (slow: ~10 min on 2 cores), or in CI its ``ci`` group: the steps whose code no other test
    runs (scripts/gpu_check.py STEP_GROUPS says where the others are tested)."""
    assert not torch.cuda.is_available(), "this test is the dry run; on a GPU run make gpu-check itself"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(tmp_path),
                             "--budget", "1500", *(["--only", only] if only else [])], cwd=ROOT, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["mode"] == "dry run (CPU)"
    assert {name: step["status"] for name, step in report["steps"].items()} == \
        {name: "passed" for name in report["steps"]}
    # what the suite runs elsewhere on CPU is left out (the script's docstring; every command line is parsed by
    # tests/unit/test_gpu_check_steps.py); the steps keep their order (the timings first)
    assert list(report["steps"]) == [name for name in STEPS
                                     if only is None or name in gpu_check_module().STEP_GROUPS[only]]
    figures = report["figures"]
    tested = {row["test"].split("[")[0] for name in ("pytest_mixers", "pytest_kernels")
              for row in figures[name]["records"]}
    assert {"test_feedback_solve_kernel_matches_reference", "test_rsa_memory_kernel_matches_reference",
            "test_model_on_device_equals_the_cpu_reference", "test_dispatch_picks_each_fast_path_with_one_log_line",
            "test_compiled_decode_equals_eager"} <= tested
    assert set(figures["decode_graphs"]["decode_ms"]) == {"teacher", "teacher, static cache + CUDA graphs",
                                                          "rsa eager", "rsa, a CUDA graph a block",
                                                          "rsa, one CUDA graph for the stack",
                                                          "rsa, one CUDA graph for the stack, states in place"}
    assert figures["decode_graphs"]["failed"] == {} and figures["decode_graphs"]["cut"] is None
    assert figures["decode_graphs"]["first_round_only"] == []
    for run in ("distill_30", "distill_30_compiled_write")[:1 if only else 2]:  # eager, then the write compiled
        assert figures[run]["steps_logged"] == 3
        assert figures[run]["profile"][0].startswith("stage2: torch.profiler over 1 step(s)")  # the third step
        assert any(line.strip().startswith("kernel_launches_per_step") for line in figures[run]["profile"])
    assert "profile_stage2_distill-run.txt" in os.listdir(tmp_path)  # the operator tables come back too
    scale = figures["scale_8b"]  # the tiny shape here: the plan, and the steps it is checked against
    assert scale["steps_logged"] == 2 and scale["plan_peak_gib"] > 0, scale
    assert scale["median_tokens_per_s"] > 0 and scale["peak_device_gib"] is None  # no CUDA here
    written = sorted(os.listdir(tmp_path))  # what comes back from a device machine: 8 files at most
    assert {"gpu_check.json", "gpu_check.log"} <= set(written) and len(written) <= 8, written
    if only:
        return
    assert figures["bench_kernels"]["results"] and figures["bench_distill"]["tokens_per_s"]["distill"] > 0
    assert figures["compiled-write/bench_distill"]["mixer_options"] == {"rsa_window": 64,
                                                                        "rsa_compile_write": "reduce-overhead"}
    assert "profile_stage2_distill-run-compiled-write.txt" in written
    assert figures["bench_generate"]["models"] == ["teacher", "rsa window=64"]
    compiled = figures["compiled/bench_generate"]  # the same bench with the compiled step, as a CUDA graph on CUDA
    assert compiled["models"] == ["teacher", "rsa window=64, compiled decode (reduce-overhead)"]
    assert all(row["budget_decode_tokens_per_s"] > 0 for row in compiled["rows"])  # the largest batch in 40 GiB
    assert "compiled_bench_generate.png" in written


def test_a_step_cut_off_by_its_limit_is_interrupted_first_so_its_summary_reaches_the_log(tmp_path):
    """At a step's time limit it gets Ctrl-C before a kill: pytest still prints which tests failed and why (the
    first H100 run lost that: its pytest step was killed mid-run and the log ended in a row of dots)."""
    gpu_check = gpu_check_module()
    # Python's own Ctrl-C handler, even where this process was started with Ctrl-C ignored (a background job), which
    # a child inherits (a full suite once saw the sleeper ignore it and be killed after the grace)
    program = ("import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
               "print('started', flush=True)\ntry:\n    time.sleep(60)\n"
               "except KeyboardInterrupt:\n    print('FAILED test_x - the summary of an interrupted run')\n")
    log_path = tmp_path / "step.log"
    with open(log_path, "w", encoding="utf-8") as log:
        result = gpu_check.run_step("sleeper", [sys.executable, "-c", program], 2, dict(os.environ), log)
    assert result["status"] == "timed out after 2 s" and result["seconds"] < 2 + gpu_check.INTERRUPT_GRACE
    assert "FAILED test_x - the summary of an interrupted run" in log_path.read_text()
