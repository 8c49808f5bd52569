"""``hf-mixers bench distill``: throughput of a stage-2 distillation step against plain LoRA fine-tuning.

Both steps run on the same batch in the same process, interleaved, fastest of ``repeats``:
  distill   the teacher's forward (no grad) + the converted student's forward/backward with LoRA and its new
            mixer parameters, KL loss, AdamW step (recipes.stages: add_lora, distillation_loss)
  baseline  a LoRA fine-tuning step of the teacher alone (same LoRA), next-token CE, AdamW step
Reported: tokens/s of each and their ratio (target: distill / baseline >= 0.6), as JSON. Runs on the GPU when
there is one (``device``), in ``dtype`` (bfloat16 is the GPU recipe's precision; the CPU default is float32).
With ``compile`` (``train.compile``'s values; "auto": on a GPU) both steps are measured again with every decoder
block of the student, the teacher and the baseline compiled, as a training run compiles them: the graphed ratio
beside the eager one, like with like.
"""

from __future__ import annotations

import copy
import json
import os
import time

import torch
import torch.nn.functional as F

from ...common.dtypes import names_of, to_dtype
from . import register_bench
from ..arguments import at_least, key_value, option_dict


def bench_distill(out_dir: str, source: str = "smollm2-135m", mixer: str = "rsa", sequence_length: int = 256,
                  batch_size: int = 2, repeats: int = 3, mixer_options: dict | None = None, device=None,
                  dtype: str = "float32", compile: bool | str = "auto") -> dict:
    from peft import LoraConfig, get_peft_model

    from .harness import bench_device
    from ...conversion import convert, load_teacher
    from ...common.corpus import shakespeare, token_blocks
    from ...kernels.conventions import COMPILE_MODES
    from ...recipes.config import DistillSection, TrainSection, compile_mode
    from ...recipes.stages import add_lora, compile_blocks, distillation_loss

    if min(sequence_length, batch_size, repeats) < 1:
        raise ValueError("bench distill: --sequence-length, --batch-size and --repeats must be >= 1")
    if not isinstance(compile, bool) and compile not in ("auto", *COMPILE_MODES):
        raise ValueError(f"bench distill: --compile must be auto, true, false or a torch.compile mode "
                         f"({', '.join(COMPILE_MODES)}), got {compile!r}")
    device = bench_device(device, "distill")
    mode = compile_mode(TrainSection(compile=compile), device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    teacher = load_teacher(source)
    for parameter in teacher.model.parameters():
        parameter.requires_grad_(False)
    teacher.model.to(device)  # converted where its weights are (a GPU's k-means and calibration), in fp32
    student, _ = convert(teacher, mixer, mixer_options=mixer_options, progress=False)
    teacher.model.to(dtype=to_dtype(dtype))
    student.to(device=device, dtype=to_dtype(dtype))
    section = DistillSection()
    distilled = add_lora(student.train(), section, seed=0)
    kd = distillation_loss(distilled, teacher.model, section.temperature, section.ce_weight)
    baseline = get_peft_model(copy.deepcopy(teacher.model).train(),
                              LoraConfig(r=section.lora_r, lora_alpha=section.lora_alpha,
                                         target_modules=list(section.lora_targets), lora_dropout=0.0))
    batch = token_blocks(teacher.tokenizer, shakespeare("train"), sequence_length, batch_size).to(device)

    def ce(model):
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    steps = {"distill": (lambda: kd(batch, False)[0], distilled), "baseline_lora": (lambda: ce(baseline), baseline)}
    optimizers = {name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
                  for name, (_, model) in steps.items()}

    def fastest_steps() -> dict:
        times = {name: [] for name in steps}
        for _ in range(repeats + 1):  # the first round warms up (and compiles) and is dropped
            for name, (loss_fn, _) in steps.items():
                began = time.perf_counter()
                optimizers[name].zero_grad(set_to_none=True)
                loss_fn().backward()
                optimizers[name].step()
                synchronize()
                times[name].append(time.perf_counter() - began)
        return {name: min(values[1:]) for name, values in times.items()}

    tokens = batch.numel()
    best = fastest_steps()
    if mode is not None:
        for model in (distilled, teacher.model, baseline):
            compile_blocks(model, mode)
        best |= {f"{name}_compiled": seconds for name, seconds in fastest_steps().items()}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"benchmark": "distill", "source": source, "mixer": mixer, "mixer_options": mixer_options or {},
              "device": device_name, "dtype": dtype,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "batch_size": batch_size,
              "sequence_length": sequence_length, "repeats": repeats,
              "step_seconds": best, "tokens_per_s": {name: tokens / s for name, s in best.items()},
              "ratio": best["baseline_lora"] / best["distill"], "target": 0.6, "compile": mode}
    if mode is not None:
        report["ratio_compiled"] = best["baseline_lora_compiled"] / best["distill_compiled"]
    report["target_met"] = max(report["ratio"], report.get("ratio_compiled", 0.0)) >= report["target"]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_distill.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(f"stage-2 distill step: {report['tokens_per_s']['distill']:.0f} tokens/s; teacher LoRA fine-tuning: "
          f"{report['tokens_per_s']['baseline_lora']:.0f} tokens/s; ratio {report['ratio']:.2f} (target >= 0.6: "
          f"{report['target_met']})" + (f"; compiled ({mode}): ratio {report['ratio_compiled']:.2f}" if mode else ""))
    return report


def _arguments(parser) -> None:
    parser.add_argument("--source", default="smollm2-135m", help="the teacher (any convert SOURCE)")
    parser.add_argument("--mixer", default="rsa", help="the mixer of the student (a registered mixer)")
    parser.add_argument("--sequence-length", type=at_least(2), default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--batch-size", type=at_least(1), default=1)
    parser.add_argument("--dtype", choices=names_of("fp32", "bf16"), default="float32")
    parser.add_argument("--compile", type=lambda text: {"true": True, "false": False}.get(text, text),
                        default="auto", metavar="{auto,true,false,MODE}",
                        help="also measure both steps with compiled blocks, as train.compile (default auto: on a GPU)")
    parser.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="a mixer option for --mixer, e.g. rsa_window=64 (repeatable)")


register_bench("distill", "one distillation step of a converted student against the teacher's forward: the ratio of "
               "their times", _arguments,
               lambda args: bench_distill(args.out, source=args.source, mixer=args.mixer,
                                          sequence_length=args.sequence_length, batch_size=args.batch_size,
                                          repeats=args.repeats, device=args.device, dtype=args.dtype,
                                          mixer_options=option_dict(args.option), compile=args.compile))
