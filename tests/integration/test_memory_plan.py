"""`hf-mixers distill RECIPE --plan` (recipes/memory_plan.py): per-process memory before anything is loaded.

The activation count is checked against a direct count of what autograd saves on the whole converted student (with
its LoRA); the weights, gradients and optimizer states against the parameter counts, for every strategy; the
verdict and the exit code of the command."""

import json
import os

import pytest
import torch

from hf_mixers.apps.cli import main as cli_main
from hf_mixers.conversion import convert, load_teacher
from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.memory_plan import parse_size, plan_memory, saved_bytes
from hf_mixers.recipes.precision import autocast
from hf_mixers.recipes.stages import add_lora

GIB = 2**30


def recipe(teacher_dir, *extra):
    return load_recipe([], [f"model.teacher={teacher_dir}", "data.sequence_length=32", "train.batch_size=2",
                            "output.dir=unused", *extra])


def saved_by_the_student(teacher_dir, mixer, options, length, dtype) -> int:
    """What autograd saves in one stage-2 forward of the converted student with its LoRA, one sequence."""
    student, _ = convert(load_teacher(str(teacher_dir)), mixer, mixer_options=options, sequence_length=32,
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    model = add_lora(student.to(dtype), load_recipe([], ["output.dir=unused"]).stage2, 0)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    hidden = model.get_base_model().model.embed_tokens(torch.randint(3, 300, (1, length)))
    with autocast(dtype, torch.device("cpu")):
        return saved_bytes(lambda: model.get_base_model().model(inputs_embeds=hidden.detach().requires_grad_(),
                                                                 use_cache=False), model)


@pytest.mark.parametrize("mixer, options, length", [("sessa", {}, 40), ("sessa", {}, 700), ("sessa", {}, 4500),
                                                    ("rsa", {"rsa_num_slots": 8, "rsa_num_levels": 2}, 700)])
def test_the_activation_count_matches_the_whole_students(teacher_dir, mixer, options, length):
    """Counted on one block per kind at two MLP widths (and, past 4096 tokens, at 1K/2K/4K and extrapolated),
    the plan's activations equal what the whole student saves, within the final norm's one (T, D) tensor."""
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plan = plan_memory(recipe(teacher_dir, f"model.mixer={mixer}", f"model.mixer_options={options}",
                                  f"data.sequence_length={length}", "train.batch_size=1", "stage1.enabled=false",
                                  f"train.precision={precision}"), device="cpu")
        planned = plan.stages["stage 2"]["activations"]
        direct = saved_by_the_student(teacher_dir, mixer, options, length, dtype)
        assert planned == pytest.approx(direct, rel=0.05), (precision, planned, direct)


def test_the_loss_logits_and_the_backward_parts_are_never_counted_at_once(teacher_dir):
    """The loss's logit chunks are freed before the backward pass makes its parts (one block recomputed under
    checkpointing, the heap's slack, the gradients): a stage's total counts the larger group, and says so. With
    accumulated micro-batches the gradients stand at the loss too."""
    settings = ["model.mixer=gltm", "train.gradient_checkpointing=true"]
    plan = plan_memory(recipe(teacher_dir, *settings), processes=2, device="cpu")
    stage = plan.stages["stage 2"]
    logits, backward = plan.apart["stage 2"]
    assert logits == ["loss logits (chunked)"]
    assert {"one block recomputed (backward)", "gradients (fp32)"} <= set(backward)
    sizes = [sum(stage[part] for part in group) for group in (logits, backward)]
    assert plan.total("stage 2") == sum(stage.values()) - min(sizes) and min(sizes) > 0
    assert plan.to_dict()["totals"]["stage 2"] == plan.peak()[1] == plan.total("stage 2")
    assert "never held at once" in plan.to_text()
    accumulating = plan_memory(recipe(teacher_dir, *settings, "train.grad_accum=2"), processes=2, device="cpu")
    assert "gradients (fp32)" not in accumulating.apart["stage 2"][1]
    assert "stage 1" not in plan.apart  # no logits there


def test_the_parts_follow_the_strategy_and_the_precision(teacher_dir):
    base = ["model.mixer=gltm", "train.precision=bf16"]
    ddp = plan_memory(recipe(teacher_dir, *base), processes=8, device="cpu").stages["stage 2"]
    zero3 = plan_memory(recipe(teacher_dir, *base, "train.strategy=deepspeed", "train.zero_stage=3"), processes=8,
                        device="cpu").stages["stage 2"]
    fsdp = plan_memory(recipe(teacher_dir, *base, "train.strategy=fsdp"), processes=8, device="cpu").stages["stage 2"]
    fp32 = plan_memory(recipe(teacher_dir, "model.mixer=gltm", "train.precision=fp32"), processes=8,
                       device="cpu").stages["stage 2"]
    assert ddp["teacher weights (bfloat16)"] * 2 == fp32["teacher weights (float32)"]
    for sharded in (zero3, fsdp):
        assert sharded["AdamW states (1/N)"] == ddp["AdamW states"] // 8
        assert sharded["gradients (fp32, 1/N)"] == ddp["gradients (fp32)"] // 8
        assert "student weights (1/N shard)" in sharded and "DDP gradient buckets" not in sharded
        assert "loss logits (chunked)" in sharded  # the student's head is the teacher's: the chunked loss runs
    assert "DDP gradient buckets" in ddp and "loss logits (chunked)" in ddp
    # AdamW: two fp32 states per trained value; the gradients one; Adafactor a row and a column per matrix
    assert ddp["AdamW states"] == 2 * ddp["gradients (fp32)"]
    adafactor = plan_memory(recipe(teacher_dir, *base, "train.optimizer=adafactor"), processes=8,
                            device="cpu").stages["stage 2"]
    assert 0 < adafactor["Adafactor states (factored)"] < ddp["AdamW states"] / 4 and "AdamW states" not in adafactor
    # on CPU loading is a stage of its own: an fp32 checkpoint read into bf16 is held beside the converted tensors
    loading = plan_memory(recipe(teacher_dir, *base), device="cpu").stages["loading"]
    assert loading["checkpoint being read (float32)"] == 2 * loading["teacher weights (bfloat16)"]
    assert "checkpoint being read (float32)" not in plan_memory(recipe(teacher_dir, "train.precision=fp32"),
                                                                device="cpu").stages["loading"]


def test_zero3s_gathered_weights_follow_its_settings_and_a_cpu_heap_is_released_on_request(teacher_dir, tmp_path):
    """ZeRO-3 gathers at most its prefetch (stage3_max_live_parameters) and its reuse window ahead: three of the
    largest blocks with the settings a run gets, less where a user's JSON allows less; on a CPU host the plan says
    that gathering fragments the heap unless train.release_host_memory (by default, "auto", on for these two), which
    measures the blocks' slack as it runs."""
    base = ["model.mixer=gltm", "train.precision=bf16", "train.strategy=deepspeed", "train.zero_stage=3",
            "train.release_host_memory=false"]
    zero3 = plan_memory(recipe(teacher_dir, *base), processes=2, device="cpu")
    fsdp = plan_memory(recipe(teacher_dir, "model.mixer=gltm", "train.precision=bf16", "train.strategy=fsdp",
                              "train.release_host_memory=false"), processes=2, device="cpu").stages["stage 2"]
    gathered = zero3.stages["stage 2"]["gathered weights (ZeRO-3 prefetch and reuse)"]
    # three blocks (at most all of them) against FSDP's two, the same embeddings and head
    assert fsdp["gathered blocks (2 in flight)"] < gathered <= 1.5 * fsdp["gathered blocks (2 in flight)"]
    assert any("train.release_host_memory" in note for note in zero3.notes)
    fragmented = "heap fragmented by gathering (up to every block once)"
    assert zero3.stages["stage 2"][fragmented] == fsdp[fragmented] > 0  # the blocks' weights in bf16
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}}')
    narrow = plan_memory(recipe(teacher_dir, *base, f"train.deepspeed_config={path}"), processes=2, device="cpu")
    assert narrow.stages["stage 2"]["gathered weights (ZeRO-3 prefetch and reuse)"] < gathered
    for release in ("true", "auto"):
        released = plan_memory(recipe(teacher_dir, *base, f"train.release_host_memory={release}"), processes=2,
                               device="cpu")
        assert not any("train.release_host_memory" in note for note in released.notes)
        assert fragmented not in released.stages["stage 2"]


def test_a_released_cpu_host_plans_only_one_batchs_rows_of_an_untied_mapped_embedding(teacher_dir, tmp_path):
    """With ``train.release_host_memory`` a CPU run hands the embedding's pages back after each lookup
    (recipes/stages.py released_per_block): of an untied embedding stored in the training dtype the plan counts what
    one batch's lookups map, at most 64 KiB a token; tied (the head reads it whole), stored in another dtype (read
    into anonymous memory) or without the release, the whole of it."""
    from conftest import save_tiny_teacher

    folder = str(tmp_path / "qwen2")  # untied
    save_tiny_teacher(folder, family="qwen2")
    config = load_teacher(folder).model.config
    embedding = config.vocab_size * config.hidden_size * 4
    plain = plan_memory(recipe(folder, "model.mixer=gltm", "train.precision=fp32"), device="cpu").stages["stage 2"]
    released = plan_memory(recipe(folder, "model.mixer=gltm", "train.precision=fp32", "train.release_host_memory=true"),
                           device="cpu").stages["stage 2"]
    rows = "embedding rows a batch looks up (mapped)"
    assert rows not in plain
    assert released["teacher weights (float32)"] == plain["teacher weights (float32)"] - embedding
    assert released[rows] == min(embedding, 2 * 32 * 64 * 2**10)
    for other in (["train.precision=bf16"], ["train.strategy=fsdp"]):  # read into bf16; a sharded student
        assert rows not in plan_memory(recipe(folder, "model.mixer=gltm", "train.release_host_memory=true", *other),
                                       device="cpu").stages["stage 2"]
    tied = plan_memory(recipe(teacher_dir, "model.mixer=gltm", "train.precision=fp32",
                              "train.release_host_memory=true"), device="cpu")
    assert rows not in tied.stages["stage 2"]  # the tiny Llama's head is its embedding


def test_a_student_folder_is_planned_as_read_one_tensor_at_a_time(teacher_dir, tmp_path):
    """A ``model.student`` folder never lies whole beside the teacher (its frozen weights are compared with the
    teacher's one stored tensor at a time, conversion/shared_weights.py): loading counts its own tensors and the
    largest stored tensor with its converted copy, not a second student."""
    student, _ = convert(load_teacher(str(teacher_dir)), "gltm", sequence_length=32, calibration_sequences=2,
                         heldout_sequences=1, progress=False)
    student.save_pretrained(tmp_path / "student")  # fp32
    plan = plan_memory(recipe(teacher_dir, f"model.student={tmp_path / 'student'}", "train.precision=bf16"),
                       device="cpu")
    loading, config = plan.stages["loading"], student.config
    own = sum(p.numel() for name, p in student.named_parameters() if ".mixer." in name
              and not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")))
    assert loading["model.student's own tensors"] == own * 4
    assert loading["its largest tensor being compared"] == config.vocab_size * config.hidden_size * (4 + 2)
    assert "model.student being read" not in loading


def test_the_command_prints_the_plan_and_says_whether_it_fits(teacher_dir, capsys):
    settings = ["--set", f"model.teacher={teacher_dir}", "--set", "model.mixer=gltm", "--set",
                "data.sequence_length=32", "--plan", "--processes", "2"]
    assert cli_main(["distill", *settings, "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "ddp over 2 processes, bfloat16 on cuda" in out and "stage 1" in out and "stage 2" in out
    assert "fits in 80.00 GiB per cuda device" in out
    assert cli_main(["distill", *settings, "--device-memory", "80GB", "--json"]) == 0  # for scripts (make gpu-check)
    planned = json.loads(capsys.readouterr().out)
    assert planned["fits"] is True and planned["processes"] == 2 and planned["device_memory"] == 80 * GIB
    peak = planned["stages"][planned["peak_stage"]]
    apart = [sum(peak[part] for part in group) for group in planned["apart"].get(planned["peak_stage"], [[]])]
    assert planned["peak_bytes"] == planned["totals"][planned["peak_stage"]] == sum(peak.values()) - min(apart)
    assert cli_main(["distill", *settings, "--device-memory", "1MB"]) == 1
    assert "does NOT fit in 0.00 GiB" in capsys.readouterr().out
    assert cli_main(["distill", *settings, "--device-memory", "lots"]) == 2
    assert "--device-memory: expected a size such as 80GB" in capsys.readouterr().err
    assert parse_size("24GiB") == parse_size("24G") == 24 * GIB and parse_size("512MB") == 512 * 2**20
    # without --device-memory on a CPU machine: its RAM shared by the processes
    plan = plan_memory(recipe(teacher_dir, "model.mixer=gltm"), processes=2, device="cpu")
    assert 0 < plan.device_memory * 2 <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert "per cpu process (this machine's RAM over the processes)" in plan.to_text() and plan.fits()


def test_a_plan_that_does_not_fit_names_the_switches_that_make_it_fit(teacher_dir, capsys):
    """``--plan`` advises: each switch that makes the run fit on its own, cheapest to the run first, with the peak it
    gives (each a re-plan that fits); when none does alone, the cheap ones together; when nothing can, it says so."""
    from hf_mixers.recipes.memory_plan import advise

    settings = ["model.mixer=gltm", "data.sequence_length=1024", "train.batch_size=32", "stage2.loss_chunk_rows=0"]
    base = recipe(teacher_dir, *settings)
    peak = plan_memory(base, 1, 80 * GIB, "cuda").peak()[1]
    plan = advise(plan_memory(base, 1, int(peak * 0.8), "cuda"), base, 1)
    assert plan.fits() is False
    switches = [overrides for overrides, _, alone in plan.advice if alone]
    assert switches[0] == ("train.gradient_checkpointing=true",) and switches[-1][0].startswith("data.sequence_length")
    assert ("train.batch_size=8", "train.grad_accum=4") in switches  # the same tokens an optimizer step
    for overrides, planned_peak, _ in plan.advice:  # each figure is the re-planned run's, and it fits
        again = plan_memory(recipe(teacher_dir, *settings, *overrides), 1, int(peak * 0.8), "cuda")
        assert again.peak()[1] == planned_peak and again.fits()
    cheap = ("train.gradient_checkpointing=true", "stage2.loss_chunk_rows=512", "train.batch_size=1",
             "train.grad_accum=32")  # every switch that keeps the training the same, at its furthest
    least = plan_memory(recipe(teacher_dir, *settings, *cheap), 1, 80 * GIB, "cuda").peak()[1]
    together = advise(plan_memory(base, 1, int(least * 1.1) + 1, "cuda"), base, 1)
    assert together.advice == [(cheap, least, False)]
    assert "no single switch makes it fit; these together do:" in together.to_text()
    hopeless = advise(plan_memory(base, 1, GIB // 2, "cuda"), base, 1)  # below the CUDA context alone
    assert not hopeless.advice and "nothing the plan can switch makes it fit" in hopeless.to_text()
    args = ["distill", *(f"--set={item}" for item in [f"model.teacher={teacher_dir}", *settings]), "--plan",
            "--device-memory", f"{peak * 0.8 / GIB:.3f}GiB"]
    assert cli_main(args) == 1
    out = capsys.readouterr().out
    assert "to fit, any one of (cheapest to the run first):" in out
    assert "  --set train.gradient_checkpointing=true: peak" in out
    assert cli_main([*args, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["advice"][0]["set"] == ["train.gradient_checkpointing=true"]
