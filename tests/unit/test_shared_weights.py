"""conversion/shared_weights.py: the student holds the weights it took over unchanged as the teacher's own storage,
computes the same, and gets copies back before anything writes into them; a distillation leaves the teacher as it
was."""

import os

import pytest
import torch

from conftest import save_tiny_teacher
from hf_mixers.conversion import convert, load_teacher
from hf_mixers.conversion.shared_weights import release_file_pages, share_frozen_weights, unshare_weights
from hf_mixers.recipes import distill, load_recipe
from hf_mixers.recipes.run_plan import plan_training


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    save_tiny_teacher(folder)
    return load_teacher(str(folder))


def _student(teacher):
    student, _ = convert(teacher, "sessa", sequence_length=32, calibration_sequences=2, heldout_sequences=1,
                         progress=False)
    return student


def test_equal_weights_are_shared_and_the_logits_do_not_change(teacher):
    student = _student(teacher)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = student(ids).logits
    freed = share_frozen_weights(student, teacher.model)
    teacher_storage = {p.data_ptr() for p in teacher.model.parameters()}
    shared = {name for name, p in student.named_parameters() if p.data_ptr() in teacher_storage}
    assert "model.embed_tokens.weight" in shared and "model.layers.0.mlp.down_proj.weight" in shared
    assert "model.layers.0.mixer.q_proj.weight" in shared  # Sessa starts from the teacher's projections
    assert not any("gamma" in name or "feedback" in name for name in shared)  # its own parameters stay its own
    assert freed == sum(p.numel() * p.element_size() for n, p in student.named_parameters() if n in shared)
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, before, rtol=0, atol=0)
    assert share_frozen_weights(student, teacher.model) == 0  # already shared


def test_kept_separate_and_unshared_weights_have_their_own_storage(teacher):
    student = _student(teacher)
    share_frozen_weights(student, teacher.model, keep_separate=(".q_proj.",))
    teacher_storage = {p.data_ptr() for p in teacher.model.parameters()}
    params = dict(student.named_parameters())
    assert params["model.layers.0.mixer.q_proj.weight"].data_ptr() not in teacher_storage
    assert params["model.layers.0.mixer.k_proj.weight"].data_ptr() in teacher_storage
    copied = unshare_weights(student, teacher.model, only=(".k_proj.",))
    assert copied > 0 and params["model.layers.0.mixer.k_proj.weight"].data_ptr() not in teacher_storage
    assert params["model.layers.0.mlp.up_proj.weight"].data_ptr() in teacher_storage


@pytest.mark.parametrize("mixer, stage1", [("sessa", []), ("rsa", ["stage1.steps=2", "stage1.train_qkv=true"])],
                         ids=["stage2", "stage1-trains-qkv"])
def test_a_distillation_with_merged_lora_leaves_the_teacher_unchanged(teacher, tmp_path, mixer, stage1):
    """Stage 2 merges LoRA into copies; a stage 1 that trains q/k/v trains copies of its own (the conversion had
    pointed them at the teacher's tensors). RSA there: Sessa is exact at init, its attention transfer has no
    gradient."""
    original = {name: p.detach().clone() for name, p in teacher.model.named_parameters()}
    recipe = load_recipe([], [f"model.mixer={mixer}", "data.sequence_length=32", "data.max_train_sequences=8",
                              "data.heldout_sequences=2", "data.wider_evaluations=false",
                              *(stage1 or ["stage1.enabled=false"]),
                              "stage2.steps=2", "stage2.lr=0.05", f"output.dir={tmp_path / 'out'}"])
    distill(recipe, progress=False, teacher=teacher)
    for name, p in teacher.model.named_parameters():
        torch.testing.assert_close(p, original[name], rtol=0, atol=0, msg=name)


def test_a_conversion_can_build_the_student_from_the_teachers_own_tensors(teacher):
    """convert(share_teacher_weights=True): embeddings, norms and MLPs are the teacher's tensors from the start (no
    clone, so conversion never holds two copies of them), and the student computes exactly what a cloned one does.
    A student in another dtype than the teacher cannot share and is refused."""
    options = dict(sequence_length=32, calibration_sequences=2, heldout_sequences=1, progress=False)
    cloned, _ = convert(teacher, "sessa", **options)
    shared, report = convert(teacher, "sessa", share_teacher_weights=True, **options)
    teacher_storage = {p.data_ptr() for p in teacher.model.parameters()}
    params = dict(shared.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight",
                 "model.layers.0.mixer.q_proj.weight", "model.layers.1.mixer.o_proj.weight"):
        assert params[name].data_ptr() in teacher_storage, name
        assert dict(cloned.named_parameters())[name].data_ptr() not in teacher_storage, name
    assert report.verified_tensors > 0
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, cloned(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="the teacher is in torch.float32, the student would be bfloat16"):
        convert(teacher, "sessa", share_teacher_weights=True, dtype="bfloat16", **options)


def test_a_shared_conversion_never_reads_the_tensors_it_shares_to_verify_them(teacher, monkeypatch):
    """Verifying a student built from the teacher's own tensors compares nothing with itself: reading a shared,
    memory-mapped embedding whole would make every row of it resident, where training touches only the rows its
    tokens use. Every tensor still counts as verified, and a copy is still compared."""
    import hf_mixers.conversion.converter as converter

    compared, equal = [], torch.equal
    monkeypatch.setattr(converter.torch, "equal", lambda a, b: compared.append(b.data_ptr()) or equal(a, b))
    options = dict(sequence_length=32, calibration_sequences=2, heldout_sequences=1, progress=False)
    _, shared_report = convert(teacher, "sessa", share_teacher_weights=True, **options)
    teacher_storage = {p.data_ptr() for p in teacher.model.state_dict().values()}
    assert not set(compared) & teacher_storage
    compared.clear()
    _, cloned_report = convert(teacher, "sessa", **options)
    assert len(compared) == cloned_report.verified_tensors == shared_report.verified_tensors > 0


def test_a_bf16_distillation_loads_the_teacher_in_bf16(teacher, tmp_path, monkeypatch):
    """train.precision=bf16: the teacher is read from its folder straight in bf16 (never an fp32 copy first), and
    the student's frozen weights are the teacher's bf16 tensors (kept so when output.dtype is bf16)."""
    import hf_mixers.recipes.stages as stages

    loaded, converted = [], []
    original_load, original_convert = stages.load_teacher, stages.convert
    monkeypatch.setattr(stages, "load_teacher", lambda source, dtype=torch.float32: loaded.append(dtype)
                        or original_load(source, dtype=dtype))
    monkeypatch.setattr(stages, "convert", lambda source, *args, **kwargs: converted.append(source.model)
                        or original_convert(source, *args, **kwargs))
    recipe = load_recipe([], [f"model.teacher={teacher.path}", "model.mixer=sessa", "data.sequence_length=32",
                              "data.max_train_sequences=4", "data.heldout_sequences=1", "data.wider_evaluations=false",
                              "stage1.enabled=false", "stage2.steps=1", "train.precision=bf16", "output.dtype=bf16",
                              f"output.dir={tmp_path / 'out'}"])
    summary = distill(recipe, progress=False)
    assert loaded == [torch.bfloat16] and summary["precision"] == "bfloat16"
    storage = {p.data_ptr() for p in converted[0].parameters()}
    embeddings = summary["model"].model.embed_tokens.weight
    assert embeddings.dtype == torch.bfloat16 and embeddings.data_ptr() in storage


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_a_student_read_from_its_folder_is_compared_as_stored_and_keeps_no_file_mapped(teacher, tmp_path, saved):
    """``stored_in``: a student just read with from_pretrained (its tensors still unread in the file's mapping) is
    compared with a bf16 teacher tensor by tensor as stored, whether the folder holds fp32 or bf16; the shared tensors
    become the teacher's, the rest its own copies, so the folder's file is no longer mapped, and the model computes
    exactly what the same folder read the usual way in bf16 does."""
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "student")
    _student(teacher).to(saved).save_pretrained(folder)
    teacher_bf16 = load_teacher(str(teacher.path), dtype=torch.bfloat16)
    student = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    freed = share_frozen_weights(student, teacher_bf16.model, stored_in=folder)
    student.to(torch.bfloat16)
    teacher_storage = {p.data_ptr() for p in teacher_bf16.model.parameters()}
    params = dict(student.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.mixer.q_proj.weight"):
        assert params[name].data_ptr() in teacher_storage, name
    assert not any(p.data_ptr() in teacher_storage for n, p in params.items() if "gamma" in n or "feedback" in n)
    assert freed == sum(p.numel() * 2 for p in params.values() if p.data_ptr() in teacher_storage)
    if os.path.isfile("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            assert os.path.join(folder, "model.safetensors") not in maps.read()
    usual = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(torch.bfloat16)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, usual(ids).logits, rtol=0, atol=0)


def test_a_sharded_stage_ends_with_the_frozen_weights_still_the_teachers(teacher, tmp_path):
    """FSDP (one process here) shards every weight of the student for a stage and makes it whole again at the end:
    the frozen weights the student shared with the teacher come back as the teacher's tensors (Sharding.kept), not
    as a gathered second copy, and the trained ones as the trained values."""
    import torch.distributed as dist

    from hf_mixers.recipes.config import DistillSection, TrainSection
    from hf_mixers.recipes.processes import Processes
    from hf_mixers.recipes.stages import add_lora, distillation_loss, sharding_for
    from hf_mixers.recipes.trainer import run_stage

    student, _ = convert(teacher, "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, sequence_length=32,
                         calibration_sequences=2, heldout_sequences=1, progress=False)
    share_frozen_weights(student, teacher.model)
    model = add_lora(student, DistillSection(), 0)
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    before = {name: p.detach().clone() for name, p in parameters.items()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run_stage("stage2", distillation_loss(model, teacher.model, 1.0, 0.0), parameters,
                  torch.randint(3, 300, (4, 16)), steps=2,
                  plan=plan_training(TrainSection(strategy="fsdp", batch_size=1), torch.device("cpu")),
                  lr=1e-2, out_dir=str(tmp_path), checkpoint_every=10, progress=False, processes=Processes(),
                  sharding=sharding_for(model, teacher_model=teacher.model))
    finally:
        dist.destroy_process_group()
    teacher_storage = {p.data_ptr() for p in teacher.model.parameters()}
    after = dict(model.named_parameters())
    frozen = [name for name, p in after.items() if not p.requires_grad]
    assert frozen and all(after[name].data_ptr() in teacher_storage for name in frozen), \
        [name for name in frozen if after[name].data_ptr() not in teacher_storage]
    assert any(not torch.equal(after[name], before[name]) for name in parameters)  # it trained


def test_fsdp_refuses_a_student_with_scalar_parameters_by_name(teacher, tmp_path):
    """FSDP2 shards along dimension 0 and cannot take Sessa's scalar gamma_bias: one line naming it and the way out,
    before anything is sharded."""
    import torch.distributed as dist

    from hf_mixers.recipes.config import TrainSection
    from hf_mixers.recipes.processes import Processes
    from hf_mixers.recipes.stages import sharding_for
    from hf_mixers.recipes.strategies import FSDPStrategy

    student = _student(teacher)
    parameters = {name: p for name, p in student.named_parameters() if "gamma" in name}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"cannot shard scalar parameters \(model.layers.0.mixer.gamma_bias"):
            FSDPStrategy(parameters, plan_training(TrainSection(strategy="fsdp"), torch.device("cpu")), 1e-3,
                         Processes(), str(tmp_path / "x"), None, sharding_for(student))
    finally:
        dist.destroy_process_group()


def _resident_pages(tensor) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = tensor.data_ptr() // page, -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start * 8)
        return sum(entry >> 63 for entry in memoryview(pagemap.read((end - start) * 8)).cast("Q"))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's /proc/self/pagemap")
def test_memory_mapped_pages_leave_resident_memory_and_come_back_unchanged(tmp_path):
    """release_file_pages drops a weight's pages when they are pages of its file (read back on the next use, the same
    values), and leaves anonymous memory and a page written since the mapping alone: dropping those would lose data."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_mixers.conversion.shared_weights import release_file_pages

    save_file({"weight": torch.randn(256, 1024)}, str(tmp_path / "w.safetensors"))  # 1 MiB
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as stored:
        weight = stored.get_tensor("weight")
    expected = weight.clone()
    assert weight.sum().item() == expected.sum().item()  # every page read in
    before = _resident_pages(weight)
    if before == 0 or release_file_pages(weight) == 0:
        pytest.skip("safetensors returned a copy, not a mapping of the file, on this platform")
    assert _resident_pages(weight) < before
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)  # read back from the file

    anonymous = torch.randn(256, 1024)
    copy = anonymous.clone()
    assert release_file_pages(anonymous) == 0 and _resident_pages(anonymous) > 0
    torch.testing.assert_close(anonymous, copy, rtol=0, atol=0)

    weight[128, 0] = 7.0  # copy-on-write: that page is the process's own now, so the tensor is left as it is
    assert release_file_pages(weight) == 0 and weight[128, 0].item() == 7.0


def _mapped_teacher(folder: str, tied: bool = True):
    """A teacher saved in bf16 with a 4 MiB embedding (8 rows a page) and loaded in bf16, as a mapping of its file;
    none of its pages resident but those its tensors share at their edges (else the test is skipped)."""
    from conftest import tiny_teacher, tiny_tokenizer

    tiny_teacher("llama", 8192, hidden_size=256, num_hidden_layers=1, tie_word_embeddings=tied).to(
        torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    teacher = load_teacher(folder, dtype=torch.bfloat16)
    for parameter in teacher.model.parameters():
        release_file_pages(parameter)
    if _resident_pages(teacher.model.model.embed_tokens.weight) > 2:
        pytest.skip("the teacher was not read as a mapping of its file on this platform")
    return teacher


def _pages(tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // os.sysconf("SC_PAGE_SIZE"))


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's /proc/self/pagemap")
def test_comparing_a_student_folder_leaves_the_teachers_mapped_embedding_unread(tmp_path):
    """Comparing a ``model.student`` folder with a memory-mapped teacher reads the teacher's tensors whole; their
    pages are handed back after it, so that a run holds of the embedding only the rows its tokens use, with the
    values unchanged."""
    from transformers import AutoModelForCausalLM

    teacher_folder, student_folder = str(tmp_path / "teacher"), str(tmp_path / "student")
    teacher = _mapped_teacher(teacher_folder)
    converted, _ = convert(teacher, "sessa", sequence_length=32, calibration_sequences=2, heldout_sequences=1,
                           progress=False, dtype="bfloat16")
    converted.save_pretrained(student_folder)
    teacher = load_teacher(teacher_folder, dtype=torch.bfloat16)  # a fresh mapping
    embedding = teacher.model.model.embed_tokens.weight
    for parameter in teacher.model.parameters():
        release_file_pages(parameter)
    expected = embedding.clone()
    release_file_pages(embedding)
    student = AutoModelForCausalLM.from_pretrained(student_folder, dtype="auto")
    assert share_frozen_weights(student, teacher.model, stored_in=student_folder) > 0
    assert student.model.embed_tokens.weight.data_ptr() == embedding.data_ptr()
    assert _resident_pages(embedding) < _pages(embedding) // 8
    torch.testing.assert_close(embedding, expected, rtol=0, atol=0)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's /proc/self/pagemap")
def test_releasing_host_memory_holds_only_the_looked_up_rows_of_a_mapped_embedding(tmp_path, monkeypatch):
    """``train.release_host_memory``: an untied embedding shared with a memory-mapped teacher hands its pages back
    after each lookup (over a run a step would otherwise leave every row it looked up resident: all of them, in
    the end); the logits are unchanged. A tied one is left alone: the head reads every row of it each step."""
    from hf_mixers.conversion import shared_weights
    from hf_mixers.recipes.config import TrainSection
    from hf_mixers.recipes.stages import released_per_block

    teacher = _mapped_teacher(str(tmp_path / "teacher"), tied=False)
    student, _ = convert(teacher, "sessa", sequence_length=32, calibration_sequences=2, heldout_sequences=1,
                         progress=False, dtype="bfloat16", share_teacher_weights=True)
    embedding = student.model.embed_tokens.weight
    assert embedding.data_ptr() == teacher.model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = student(ids).logits
        assert _resident_pages(embedding) > _pages(embedding) // 4  # 256 rows looked up, their neighbours mapped
        release_file_pages(embedding)
        with released_per_block(student, plan_training(TrainSection(release_host_memory=True), torch.device("cpu"))):
            got = student(ids).logits
        assert _resident_pages(embedding) <= 2
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    released = []
    monkeypatch.setattr(shared_weights, "release_file_pages", released.append)
    tied_teacher = _mapped_teacher(str(tmp_path / "tied"), tied=True)
    tied, _ = convert(tied_teacher, "sessa", sequence_length=32, calibration_sequences=2, heldout_sequences=1,
                      progress=False, dtype="bfloat16", share_teacher_weights=True)
    with torch.no_grad(), released_per_block(tied, plan_training(TrainSection(release_host_memory=True),
                                                                 torch.device("cpu"))):
        tied(ids)
    assert released == []


@pytest.mark.parametrize("checkpointing", [False, True])
def test_freed_memory_is_released_at_every_block_boundary_forward_and_backward(teacher, monkeypatch, checkpointing):
    """``train.release_host_memory``: a release before and after each block's forward and one as each block's output
    gradient arrives (a checkpointed block's recomputation bypasses the module hooks, so the gradient hook is what
    marks the backward), the gradients unchanged, and no hook left once the stage is over."""
    from hf_mixers.conversion import shared_weights

    student = _student(teacher).train()
    if checkpointing:
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    blocks = student.model.layers
    ids = torch.randint(3, 300, (1, 24))

    def gradients():
        student.zero_grad()
        student(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in student.parameters() if p.grad is not None]

    expected = gradients()
    calls = []
    monkeypatch.setattr(shared_weights, "_MALLOC_TRIM", lambda pad: calls.append(torch.is_grad_enabled()))
    with shared_weights.freed_memory_released_per_block(blocks):
        student.zero_grad()
        loss = student(input_ids=ids, labels=ids).loss
        assert len(calls) == 2 * len(blocks)
        loss.backward()
        assert len(calls) >= 3 * len(blocks)
        got = [p.grad.clone() for p in student.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == len(expected)
    calls.clear()
    gradients()
    assert calls == []


def test_a_stage_releases_per_block_only_on_request_and_on_a_cpu_host(teacher, monkeypatch):
    """recipes/stages.py ``released_per_block`` (stage 2 and finetune): hooks on the decoder blocks of the model
    as the stage trains it (a LoRA-wrapped one too) with ``train.release_host_memory`` on a CPU host, none else;
    its default, "auto", releases under fsdp and deepspeed (every ZeRO stage) and not under ddp."""
    from hf_mixers.conversion import shared_weights
    from hf_mixers.recipes.config import TrainSection, releases_host_memory
    from hf_mixers.recipes.stages import add_lora, released_per_block

    model = add_lora(_student(teacher), load_recipe([], ["output.dir=unused"]).stage2, 0)
    calls = []
    monkeypatch.setattr(shared_weights, "_MALLOC_TRIM", lambda pad: calls.append(pad))
    ids = torch.randint(3, 300, (1, 16))
    every_block = 2 * len(model.get_decoder().layers)
    cases = ((True, "ddp", "cpu", every_block), (False, "fsdp", "cpu", 0), (True, "ddp", "meta", 0),
             ("auto", "fsdp", "cpu", every_block), ("auto", "ddp", "cpu", 0), ("auto", "fsdp", "meta", 0))
    for release, strategy, device, expected in cases:
        calls.clear()
        train = TrainSection(release_host_memory=release, strategy=strategy)
        with released_per_block(model, plan_training(train, torch.device(device))):
            with torch.no_grad():
                model(input_ids=ids)
        assert len(calls) == expected, (release, strategy, device)
    assert all(releases_host_memory(TrainSection(strategy="deepspeed", zero_stage=stage)) for stage in (1, 2, 3))
    assert not releases_host_memory(TrainSection(strategy="deepspeed", release_host_memory=False))
