"""Bad input, by class: every numeric flag and recipe field has a range, checked before any work, named in the error.

Each class is tested as a class (every flag, every field), not only by the example that found it.
"""

import argparse
import os
import shutil
import dataclasses
import typing

import pytest

from hf_mixers.apps.bench import target_parser, targets
from hf_mixers.apps.cli import build_parser, main
from hf_mixers.recipes import RecipeError, load_recipe
from hf_mixers.recipes.config import Recipe

COMMAND_PREFIX = {("convert",): ["convert", "teacher", "--mixer", "rsa", "--out", "out"], ("eval",): ["eval", "model"],
                  ("demo",): ["demo"], **{("bench", name): ["bench", name] for name in targets()}}


def _parsers():
    """(the command's words, its parser) of every command and of every benchmark target (its own parser)."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    yield from (((command,), sub) for command, sub in commands.items())
    yield from ((("bench", name), target_parser(target)) for name, target in targets().items())


def _numeric_flags():
    """(command words, flag, least) of every integer option of every command."""
    for words, sub in _parsers():
        for action in sub._actions:
            if action.type is int or action.type is float:
                yield words, action.option_strings[0], None
            name = getattr(action.type, "__name__", "")
            if name == "number > 0":
                continue  # positive_number: checked (tests/integration/test_cli.py, bench generate)
            if name.startswith("integer >= "):
                yield words, action.option_strings[0], int(name.removeprefix("integer >= "))


def test_no_numeric_flag_is_unchecked():
    unchecked = [(words, flag) for words, flag, least in _numeric_flags() if least is None]
    assert not unchecked, f"integer flags without a range: {unchecked}"


@pytest.mark.parametrize("words, flag, least", [f for f in _numeric_flags() if f[0] in COMMAND_PREFIX],
                         ids=lambda value: " ".join(value) if isinstance(value, tuple) else str(value))
def test_a_numeric_flag_below_its_range_is_one_line_naming_it(words, flag, least, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*COMMAND_PREFIX[words], flag, str(least - 1)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: must be >= {least}, got {least - 1}" in error


def test_a_flag_of_another_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "sessa", "--variants", "mamba2", "--decode-batch", "4"])
    assert exit_info.value.code == 2
    assert "hf-mixers bench sessa: error: unrecognized arguments: --variants mamba2 --decode-batch 4" in \
        capsys.readouterr().err


def test_list_flags_refuse_non_positive_entries(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "rsa", "--contexts", "1024,0"])
    assert "argument --contexts: expected comma-separated integers >= 1, got '1024,0'" in capsys.readouterr().err


def _bounded_fields():
    for section in dataclasses.fields(Recipe):
        for item in dataclasses.fields(section.default_factory()):
            hint = typing.get_type_hints(section.default_factory)[item.name]
            numeric = {int, float} & set(typing.get_args(hint) or (hint,))
            if numeric and item.type != "bool":
                yield section.name, item.name, item.metadata.get("range")


def test_every_numeric_recipe_field_declares_its_range():
    unbounded = [f"{s}.{n}" for s, n, bounds in _bounded_fields() if bounds is None]
    assert unbounded == ["train.zero_stage"]  # a choice (1, 2 or 3), checked by name in _validate


@pytest.mark.parametrize("section, name, bounds", [f for f in _bounded_fields() if f[2] is not None],
                         ids=lambda value: str(value))
def test_a_recipe_number_out_of_range_names_the_key_and_range(section, name, bounds):
    low, high, low_open, high_open = bounds
    bad = low if low_open else low - 1
    # named with where the value came from: the --set that gave it, not a recipe file that does not hold it
    with pytest.raises(RecipeError, match=rf"^--set {section}\.{name}={bad}: {section}\.{name} must be [>]=? {low}.*"
                                          rf", got {bad}"):
        load_recipe([], [f"{section}.{name}={bad}"])
    if high is not None:
        too_high = high if high_open else high + 1
        with pytest.raises(RecipeError, match=rf"{section}\.{name} must be .*, got {too_high}"):
            load_recipe([], [f"{section}.{name}={too_high}"])


def test_an_enabled_stage_with_no_steps_is_refused():
    with pytest.raises(RecipeError, match="stage2.steps is 0 but the stage is enabled: set stage2.enabled=false"):
        load_recipe([], ["stage2.steps=0"])
    assert load_recipe([], ["stage2.steps=0", "stage2.enabled=false"]).stage2.steps == 0


def test_the_library_refuses_the_same_numbers_before_any_work():
    from hf_mixers.common.corpus import token_blocks
    from hf_mixers.conversion import convert

    with pytest.raises(ValueError, match="sequence_length must be an integer >= 2, got 0"):
        convert("no/such/teacher", "rsa", sequence_length=0)
    with pytest.raises(ValueError, match="heldout_sequences must be an integer >= 1, got 0"):
        convert("no/such/teacher", "rsa", heldout_sequences=0)
    with pytest.raises(ValueError, match="calibration text: token blocks need a positive integer length, got 0"):
        token_blocks(None, "to be or not to be", 0, 4, what="calibration text")


# ------------------------------------------------------------------ raw tracebacks that became one named line


def _one_line(capsys, *fragments):
    """stderr holds one error line (progress bars aside), no traceback, and it names ``fragments``."""
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("hf-mixers")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


def _distill(teacher_dir, out, *extra):
    return main(["distill", "--set", f"model.teacher={teacher_dir}", "--set", "data.sequence_length=32",
                 "--set", "data.max_train_sequences=4", "--set", "stage1.steps=1", "--set", "stage2.steps=1",
                 "--set", f"output.dir={out}", *[item for pair in extra for item in ("--set", pair)]])


def test_data_that_cannot_make_one_sequence_is_named_and_leaves_nothing(teacher_dir, tmp_path, capsys):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_text("\n\n  \n")
    short.write_text("To be, or not to be.\n\nThat is the question.\n")
    assert _distill(teacher_dir, tmp_path / "a", f"data.source={empty}") == 2
    _one_line(capsys, f"{empty}: no text in it")
    assert _distill(teacher_dir, tmp_path / "b", f"data.source={short}") == 2
    _one_line(capsys, f"the training text of {short} is shorter than one sequence of 32 tokens")
    assert not (tmp_path / "a" / "recipe.json").exists() and not (tmp_path / "b" / "recipe.json").exists()


def test_a_missing_student_folder_is_named_as_a_folder(teacher_dir, tmp_path, capsys):
    for student in (tmp_path / "no" / "such" / "model", "out/model"):  # the second looks like a hub id
        assert _distill(teacher_dir, tmp_path / "run", f"model.student={student}") == 2
        _one_line(capsys, f"model.student: {student} is not a folder")


def test_a_binary_calibration_file_is_named(teacher_dir, tmp_path, capsys):
    binary = tmp_path / "calibration.txt"
    binary.write_bytes(bytes(range(256)) * 64)
    assert main(["convert", teacher_dir, "--mixer", "rsa", "--out", str(tmp_path / "out"), "--calibration",
                 str(binary)]) == 2
    _one_line(capsys, f"{binary}: not UTF-8 text")


def test_an_output_that_cannot_be_written_is_one_line_and_nothing_is_left(teacher_dir, tmp_path, capsys,
                                                                          monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    options = ["--sequence-length", "16", "--calibration-sequences", "1", "--heldout-sequences", "1",
               "--option", "rsa_num_slots=4", "--option", "rsa_num_levels=1"]
    assert main(["convert", teacher_dir, "--mixer", "rsa", "--out", str(blocker / "out"), *options]) == 2
    _one_line(capsys, f"cannot create it, {blocker} is a file, not a folder")

    import errno

    from hf_mixers.model.modeling import MixerPreTrainedModel

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MixerPreTrainedModel, "save_pretrained", full_disk)
    assert main(["convert", teacher_dir, "--mixer", "rsa", "--out", str(tmp_path / "full"), *options]) == 3  # a fault
    _one_line(capsys, "No space left on device", "nothing was half-written")
    assert not [p for p in os.listdir(tmp_path) if p.startswith((".full", "full"))]


def test_eval_refuses_a_teacher_of_another_vocabulary_and_a_folder_without_weights(teacher_dir, tmp_path, capsys):
    from conftest import tiny_teacher, tiny_tokenizer

    other = tmp_path / "other-teacher"
    tiny_teacher("llama", 500).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert main(["eval", teacher_dir, "--teacher", str(other), "--heldout-sequences", "1"]) == 2
    _one_line(capsys, "its vocabulary has 500 tokens", "has 384")
    empty = tmp_path / "no-weights"
    shutil.copytree(teacher_dir, empty)
    os.remove(empty / "model.safetensors")
    assert main(["eval", str(empty), "--teacher", "none"]) == 2
    _one_line(capsys, "no *.safetensors weights")


@pytest.mark.parametrize("repo_id", ["not a repo", "user/tiny/extra", "-user/tiny", "user/" + "x" * 100])
def test_push_and_card_refuse_an_invalid_repo_id_before_any_work(tmp_path, capsys, repo_id):
    assert main(["push", "--dry-run", "--", repo_id, str(tmp_path)]) == 2
    _one_line(capsys, f"repo id {repo_id!r} is not a valid model repository id")
    assert main(["card", str(tmp_path), f"--repo-id={repo_id}"]) == 2  # the card checks it too, before any work
    _one_line(capsys, f"repo id {repo_id!r} is not a valid model repository id")


def test_a_moved_run_folder_is_the_same_run():
    from hf_mixers.recipes.config import recipe_changes

    recorded = load_recipe([], ["output.dir=/old/place", "train.lr=0.01"]).to_dict()
    assert recipe_changes(recorded, load_recipe([], ["output.dir=/new/place", "train.lr=0.01",
                                                     "stage2.steps=500", "output.merge_lora=false"])) == []
    assert recipe_changes(recorded, load_recipe([], ["output.dir=/new/place"])) == ["train.lr: 0.01 -> 0.001"]


def test_a_device_that_is_not_there_is_one_line_before_any_work(tmp_path, capsys):
    for argv in (["bench", "sessa", "--out", str(tmp_path / "bench")], ["eval", str(tmp_path / "no-model")]):
        assert main([*argv, "--device", "nosuch"]) == 2
        _one_line(capsys, "--device 'nosuch' is not a device (use cpu, cuda or cuda:N)")
    assert not os.path.exists(tmp_path / "bench")


def test_mixer_options_follow_one_naming_rule_and_are_checked_before_any_work(tmp_path, capsys):
    """The short name works everywhere (window = rsa_window); an unknown option or a refused value is named, with
    the value, before the teacher is loaded (the teacher here does not exist)."""
    from hf_mixers import get_mixer

    assert get_mixer("rsa").checked_options({"window": 8}, "x") == {"rsa_window": 8}
    cases = {("diagnose", "rsa", "--option", "nosuch=1"): "diagnose --option: unknown rsa option 'nosuch'",
             ("diagnose", "rsa", "--option", "window=8", "--option", "rsa_window=4"): "rsa_window is given twice",
             ("diagnose", "rsa", "--option", "window=8", "--option", "window=4"): "--option window is given twice",
             ("convert", "no/such-teacher", "--mixer", "rsa", "--option", "window=8", "--option", "window=4"):
                 "--option window is given twice",
             ("distill", "--set", "model.teacher=no/such-teacher", "--set", "model.mixer_options.window=abc"):
                 "model.mixer_options: rsa_window ",
             ("distill", "--set", "model.teacher=no/such-teacher", "--set", "model.mixer=nosuch"):
                 "model.mixer: unknown mixer 'nosuch'"}
    for argv, message in cases.items():
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2, argv
        _one_line(capsys, message)
        assert not (tmp_path / "out").exists()
    assert main(["distill", "--set", "model.teacher=no/such-teacher", "--set", "model.mixer_options.window=abc",
                 "--out", str(tmp_path / "out")]) == 2
    assert "'abc'" in capsys.readouterr().err  # the bad value is shown


def test_outputs_under_a_file_folders_without_a_config_and_binary_text_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    binary = tmp_path / "text.bin"
    binary.write_bytes(bytes(range(256)))
    (tmp_path / "empty-folder").mkdir()
    cases = {("compare", "--mixer", "sessa", "--out", str(blocker / "c")): f"{blocker} is a file, not a folder",
             ("reproduce", "sessa-tail", "--out", str(blocker / "r")): f"{blocker} is a file, not a folder",
             ("diagnose", str(tmp_path / "empty-folder"), "--out", str(tmp_path / "d")): "has no config.json",
             ("diagnose", "rsa", "--text", str(binary), "--out", str(tmp_path / "d")): f"--text {binary}: not UTF-8",
             ("diagnose", "rsa", "--length", "10000000", "--out", str(tmp_path / "d")): "GiB available: lower --length"}
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        _one_line(capsys, message)


def test_a_full_disk_is_found_before_training_and_a_failed_write_is_one_line(teacher_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """A stage whose checkpoints cannot fit refuses before it trains; safetensors' own write error (its text holds
    the OS error) is the OSError it stands for: one line, exit 3 (a fault of the machine), nothing half-written."""
    import collections

    from safetensors import SafetensorError

    import hf_mixers.recipes.checkpoint as checkpoint
    import hf_mixers.recipes.trainer as trainer
    from test_recipes import small

    settings = [part for item in small(teacher_dir, tmp_path / "run", "stage1.steps=2", "stage2.steps=2")
                for part in ("--set", item)]
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(trainer.shutil, "disk_usage", lambda path: usage(1, 1, 0))
    assert main(["distill", *settings]) == 3
    _one_line(capsys, "the checkpoints need about", "GiB are free")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step was trained
    monkeypatch.undo()

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    assert main(["distill", *settings, "--set", "output.overwrite=true"]) == 3
    _one_line(capsys, "No space left on device (writing ", "stage1.safetensors", "nothing was half-written")
    assert not [name for name in os.listdir(tmp_path / "run" / "checkpoints") if ".partial" in name]


@pytest.mark.parametrize("command", ["convert", "distill", "distill's export"])
def test_a_real_file_size_limit_is_one_line_exit_3_and_nothing_half_written(teacher_dir, tmp_path, command):
    """A real fault, not a built message: ``ulimit -f`` in a child process, so safetensors' own write fails (EFBIG)
    as on a full disk: convert's model folder, distill's stage-1 checkpoint, distill's final export (stage 2's LoRA
    checkpoints fit, the model does not). One line naming what was being written, exit 3 (a machine fault), no
    partial output; the same command without the limit then finishes (after the export: from its checkpoint)."""
    import subprocess
    import sys

    from test_recipes import small

    out = tmp_path / "out"
    stages = ["stage1.enabled=false", "stage2.steps=2"] if command == "distill's export" else \
        ["stage1.steps=1", "stage2.steps=1"]
    words = ["convert", teacher_dir, "--mixer", "rsa", "--out", str(out)] if command == "convert" else \
        ["distill", *[part for item in small(teacher_dir, out, *stages) for part in ("--set", item)]]
    # KiB: the packed data and logs fit, the tiny model (~570 KiB) does not; nor does its stage-1 checkpoint at 100,
    # while its stage-2 checkpoint (~250 KiB) fits at 400
    limit = 400 if command == "distill's export" else 100
    result = subprocess.run(["bash", "-c", f'ulimit -f {limit}; exec "$@"', "bash", sys.executable, "-m",
                             "hf_mixers", *words], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"hf-mixers {words[0]}: error:")]
    assert result.returncode == 3, result.stderr[-2000:]
    assert len(lines) == 1 and "File too large (writing " in lines[0] and "Traceback" not in result.stderr, \
        result.stderr[-2000:]
    assert not [path for path in tmp_path.rglob("*") if ".partial" in path.name]
    if command == "distill's export":
        assert "model" in lines[0] and (out / "checkpoints" / "stage2.safetensors").exists()
        again = subprocess.run([sys.executable, "-m", "hf_mixers", *words], capture_output=True, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert (out / "model" / "config.json").exists()


@pytest.mark.parametrize("command", ["convert", "distill"])
def test_ctrl_c_is_one_line_exit_130_and_nothing_half_written(teacher_dir, tmp_path, command):
    """A real SIGINT to a child process once it is converting: one line, exit 130 (the shell's code for it), no
    traceback, no partial file or folder; distill says the same command resumes."""
    import signal
    import subprocess
    import sys

    from test_recipes import small

    out = tmp_path / "out"
    words = {"convert": ["convert", teacher_dir, "--mixer", "rsa", "--out", str(out)],
             "distill": ["distill", *[part for item in small(teacher_dir, out) for part in ("--set", item)]]}[command]
    # SIGINT as a terminal leaves it: a test process may ignore it (then so would its child, and Python would never
    # raise KeyboardInterrupt there), so the child starts with the default disposition
    child = subprocess.Popen([sys.executable, "-m", "hf_mixers", *words], stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in child.stderr:
        if line.startswith("converting"):
            child.send_signal(signal.SIGINT)
            break
    stderr = child.stderr.read()
    assert child.wait(timeout=120) == 130, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("hf-mixers")]
    resumes = " (the same command resumes from the last checkpoint)" if command == "distill" else ""
    assert lines == [f"hf-mixers {command}: interrupted{resumes}"] and "Traceback" not in stderr, stderr[-2000:]
    assert not [path for path in tmp_path.rglob("*") if ".partial" in path.name]
    assert not (out / "model").exists() and not (out / "config.json").exists()
    assert not out.exists()  # distill's packed data and the folder it made: a run that never started leaves none


def test_a_run_that_fails_before_it_starts_leaves_nothing_and_names_the_file(teacher_dir, tmp_path):
    """``ulimit -f`` of 2 KiB: TensorBoard's first event file, or without a tracker the packed training data, cannot
    be written. Each is one line naming the folder or file with its errno (exit 3, a machine fault), and the run,
    which never started, leaves no tracker folder, data, recipe.json or output folder behind; a folder that was
    there before keeps what was in it."""
    import subprocess
    import sys

    from test_recipes import small

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for out, trackers, named in ((tmp_path / "new", "[tensorboard]", "could not write its logs (File too large): '"
                                  f"{tmp_path / 'new' / 'tensorboard'}'"),
                                 (tmp_path / "new", "[]", f"File too large: '{tmp_path / 'new' / 'data'}"),
                                 (kept, "[]", f"File too large: '{kept / 'data' / 'train.int32'}'")):
        words = ["distill", *[part for item in small(teacher_dir, out, "stage1.steps=1", "stage2.steps=1",
                                                     f"train.report_to={trackers}") for part in ("--set", item)]]
        result = subprocess.run(["bash", "-c", 'ulimit -f 2; exec "$@"', "bash", sys.executable, "-m", "hf_mixers",
                                 *words], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.startswith("hf-mixers distill: error:")]
        assert result.returncode == 3, result.stderr[-2000:]
        assert len(lines) == 1 and named in lines[0], lines
        assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(kept)) == ["notes.txt"]


def test_a_value_out_of_range_is_blamed_on_where_it_was_set(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("stage2: {steps: 4}\ntrain: {lr: 0.01}\n")
    with pytest.raises(RecipeError, match=r"^--set stage2.steps=-1: stage2.steps must be >= 0"):
        load_recipe([str(recipe)], ["stage2.steps=-1"])
    recipe.write_text("stage2: {steps: -1}\n")
    with pytest.raises(RecipeError, match=rf"^{recipe}: stage2.steps must be >= 0"):
        load_recipe([str(recipe)], ["train.lr=0.01"])


def test_a_stage_with_nothing_to_learn_is_one_line(teacher_dir, tmp_path, capsys):
    """Windowed RSA on sequences no longer than its window: stage 1's loss never reaches the memory it trains."""
    from test_recipes import small

    settings = [part for item in small(teacher_dir, tmp_path / "run", "model.mixer_options={rsa_num_slots: 4, "
                                       "rsa_num_levels: 1, rsa_window: 32}", "stage1.steps=1", "stage2.steps=1")
                for part in ("--set", item)]
    assert main(["distill", *settings]) == 2
    _one_line(capsys, "stage1: the loss does not depend on any parameter the stage trains",
              "data.sequence_length <= the mixer's window")
