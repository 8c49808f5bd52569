"""`make gpu-check` without CUDA is a dry run: every step of scripts/gpu_check.py on CPU at tiny sizes (the CUDA tier
tests/gpu under the Triton interpreter, the benches, a two-step distillation), so that the script a GPU session runs
at once cannot rot between the rare sessions that are lent one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_passes_every_step_and_writes_its_figures(tmp_path):
    assert not torch.cuda.is_available(), "this test is the dry run; on a GPU run make gpu-check itself"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(tmp_path),
                             "--budget", "1500"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["environment"]["mode"] == "dry run (CPU)"
    assert {name: step["status"] for name, step in report["steps"].items()} == \
        {name: "passed" for name in report["steps"]}
    assert {"compile-sessa-llama3-8b", "compile-rsa-smollm2-135m", "pytest-mixers", "pytest-kernels",
            "bench-kernels", "teacher", "bench-distill", "distill-30", "bench-rsa", "bench-sessa"} <= \
        set(report["steps"])
    figures = report["figures"]
    tested = {row["test"].split("[")[0] for name in ("pytest_mixers", "pytest_kernels")
              for row in figures[name]["records"]}
    assert {"test_feedback_solve_kernel_matches_reference", "test_rsa_memory_kernel_matches_reference",
            "test_model_on_device_equals_the_cpu_reference", "test_dispatch_picks_each_fast_path_with_one_log_line",
            "test_compiled_decode_equals_eager"} <= tested
    assert figures["bench_kernels"]["results"] and figures["bench_distill"]["tokens_per_s"]["distill"] > 0
    assert figures["distill_30"]["steps_logged"] == 2
    assert figures["bench_rsa"] and figures["bench_sessa"]
    written = sorted(os.listdir(tmp_path))  # what comes back from a device machine: 8 files at most
    assert {"gpu_check.json", "gpu_check.log"} <= set(written) and len(written) <= 8, written
