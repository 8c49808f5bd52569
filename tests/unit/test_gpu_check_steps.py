"""scripts/gpu_check.py's own logic that a rare GPU lease depends on: what a run compiled comes back as one archive
under the size a file from the device may have, Triton's cache first, and the next run unpacks it where Triton and
Inductor look; the decode-graphs step keeps what it measured when its time limit cuts it."""

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fill(folder: Path, part: str, size: int) -> None:
    (folder / part / "entry").mkdir(parents=True)
    (folder / part / "entry" / "kernel.bin").write_bytes(os.urandom(size))  # random: gzip cannot shrink it


def test_the_cache_round_trips_into_the_folders_triton_and_inductor_read(gpu_check, tmp_path):
    fill(tmp_path / "run1", "triton", 1000)
    fill(tmp_path / "run1", "inductor", 1000)
    archive = tmp_path / "cache.tar.gz"
    kept = gpu_check.save_compile_cache(str(tmp_path / "run1"), str(archive))
    assert kept["saved"] == ["triton", "inductor"] and kept["bytes"] == archive.stat().st_size
    environment = gpu_check.restore_compile_cache(archive, str(tmp_path / "run2"))
    for part, variable in (("triton", "TRITON_CACHE_DIR"), ("inductor", "TORCHINDUCTOR_CACHE_DIR")):
        assert environment[variable] == str(tmp_path / "run2" / part)
        assert (Path(environment[variable]) / "entry" / "kernel.bin").read_bytes() == \
            (tmp_path / "run1" / part / "entry" / "kernel.bin").read_bytes()


def test_over_the_limit_the_triton_cache_alone_or_nothing(gpu_check, tmp_path):
    fill(tmp_path, "triton", 4000)
    fill(tmp_path, "inductor", 8000)
    archive = tmp_path / "cache.tar.gz"
    assert gpu_check.save_compile_cache(str(tmp_path), str(archive), limit=6000)["saved"] == ["triton"]
    kept = gpu_check.save_compile_cache(str(tmp_path), str(tmp_path / "none.tar.gz"), limit=2000)
    assert kept["saved"] == [] and "over 2000 bytes" in kept["why"]
    assert not (tmp_path / "none.tar.gz").exists() and not (tmp_path / "none.tar.gz.partial").exists()


def test_no_archive_is_an_empty_cache(gpu_check, tmp_path):
    environment = gpu_check.restore_compile_cache(tmp_path / "absent.tar.gz", str(tmp_path / "cache"))
    assert os.path.isdir(tmp_path / "cache") and set(environment) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}
    assert gpu_check.save_compile_cache(str(tmp_path / "cache"), str(tmp_path / "out.tar.gz"))["saved"] == []


def test_decode_graphs_keeps_what_it_measured_when_its_time_limit_cuts_it(gpu_check, tmp_path, monkeypatch):
    """The decode-graphs step writes its JSON after every measurement, each form measured as soon as it compiled: cut
    by the step's time limit (Ctrl-C: KeyboardInterrupt) while a later form compiles, the forms measured so far are
    there, first-round figures marked, and where it was cut."""
    import json

    from hf_mixers.common import measures
    from hf_mixers.decode import engine

    teacher = tmp_path / "teacher"
    gpu_check.make_teacher(str(teacher), "tiny")
    def step_seconds(model, *args, **kwargs):  # the teacher, RSA eager, then the first compiled form is interrupted
        if getattr(model.config, "compile_decode", False) not in (False, "auto"):  # "auto": eager here
            raise KeyboardInterrupt
        return 0.01 if type(model).__name__ == "LlamaForCausalLM" else 0.02

    monkeypatch.setattr(measures, "decode_step_seconds", step_seconds)
    monkeypatch.setattr(gpu_check, "static_teacher_step_seconds", lambda *args, **kwargs: 0.005)
    out = tmp_path / "decode_graphs.json"
    settings = (engine.COMPILE_BACKEND, engine.STACK_DEVICES, engine.IN_PLACE_DEVICES)
    with pytest.raises(SystemExit) as stopped:
        gpu_check.decode_graphs(str(teacher), str(out), dry=True)
    assert stopped.value.code == 130
    # the dry run's aot_eager and each form's stack settings do not outlive the step (a later test would compile
    # through them)
    assert (engine.COMPILE_BACKEND, engine.STACK_DEVICES, engine.IN_PLACE_DEVICES) == settings
    report = json.loads(out.read_text())
    assert report["decode_ms"] == pytest.approx({"teacher": 10.0, "teacher, static cache + CUDA graphs": 5.0,
                                                 "rsa eager": 20.0})
    assert report["first_round_only"] == list(report["decode_ms"])
    assert report["cut"] == "round 0, at 'rsa, a CUDA graph a block'" and report["failed"] == {}
    assert report["x_teacher_tokens_per_s"]["rsa eager"] == pytest.approx(0.5)
    assert not (tmp_path / "decode_graphs.json.partial").exists()


def test_only_takes_step_names_and_groups_and_refuses_a_name_that_is_neither(gpu_check, capsys):
    """``--only``: step names and the groups (serve, train), in the steps' order; a typo is refused by name before
    anything runs (it used to run nothing, silently)."""
    every = gpu_check.steps(["python"], "/work", dry=True)
    names = [step[0] for step in every]
    for members in gpu_check.STEP_GROUPS.values():
        assert set(members) <= set(names), set(members) - set(names)
    chosen = [step[0] for step in gpu_check.select_steps(every, "train,pytest-kernels")]
    assert chosen == [name for name in names if name in {*gpu_check.STEP_GROUPS["train"], "pytest-kernels"}]
    assert gpu_check.select_steps(every, None) == every
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--dry-run", "--only", "serve,decode-graph"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--only: no step or group ['decode-graph']" in error and "decode-graphs" in error and "serve (" in error


@pytest.mark.parametrize("dry", [False, True], ids=["cuda", "dry-run"])
def test_every_steps_command_line_is_one_its_program_takes(gpu_check, dry):
    """Each step's command, as a GPU run and as the dry run build it, parses: `hf-mixers` arguments with the CLI's
    own parser, pytest's files exist, the script's own entries are its flags. The dry run leaves out steps the
    suite runs elsewhere (bench-rsa, bench-sessa), so a GPU-only flag there would otherwise first fail on a lease."""
    from hf_mixers.apps.bench import target_parser, targets
    from hf_mixers.apps.cli import build_parser

    parser = build_parser()
    todo = gpu_check.steps(["python"], "/work", dry)
    names = {name for name, *_ in todo}
    elsewhere = {"bench-rsa", "bench-sessa", "pytest-triton", "scale-1b", "compile-rsa-smollm2-135m",
                 "kernel-resources-smollm2-135m", "kernel-resources-llama3-8b"}
    resources = _kernel_resources_parser()
    assert names.isdisjoint(elsewhere) if dry else elsewhere <= names
    for name, argv, limit, _ in todo:
        assert argv[0] == "python" and limit > 0, name
        if argv[1:3] == ["-m", "hf_mixers"]:
            arguments = parser.parse_args(argv[3:])  # argparse exits (SystemExit 2) on a flag it does not take
            assert arguments.command == argv[3], name
            if arguments.command == "bench":  # a bench target's flags: its own parser
                target_parser(targets()[arguments.target]).parse_args(arguments.options)
        elif argv[1:3] == ["-m", "pytest"]:
            files = [part for part in argv if part.startswith("tests/")]
            assert files and all((ROOT / part).is_file() for part in files), name
        elif argv[1] == str(ROOT / "scripts" / "kernel_resources.py"):
            assert resources.parse_args(argv[2:]).out.endswith(".json"), name
        else:
            assert argv[1] == str(ROOT / "scripts" / "gpu_check.py") and argv[2] in (
                "--warm", "--make-teacher", "--decode-graphs", "--scale"), name


def _kernel_resources_parser():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_resources", ROOT / "scripts" / "kernel_resources.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.build_parser()
