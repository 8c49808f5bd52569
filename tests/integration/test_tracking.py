"""train.report_to (recipes/tracking.py): accelerate's trackers, the installed ones under "all", none under [], a
named one that is not installed refused before any work; and the logging every command configures (--verbose)."""

import importlib.util
import logging

import pytest

from hf_mixers.apps.cli import configure_logging
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.recipes import distill, load_recipe
from hf_mixers.recipes.config import TrainSection
from hf_mixers.recipes.tracking import trackers


def small(teacher_dir, out, *extra):
    return load_recipe([], [f"model.teacher={teacher_dir}", "model.mixer=gltm", "data.sequence_length=32",
                            "data.max_train_sequences=4", "data.heldout_sequences=1", "data.wider_evaluations=false",
                            "stage1.enabled=false", "stage2.steps=1", f"output.dir={out}", *extra])


def test_all_takes_every_installed_tracker_and_a_name_is_checked():
    assert "tensorboard" in trackers(TrainSection(report_to=["all"]))
    assert trackers(TrainSection(report_to=[])) == []
    with pytest.raises(ValueError, match=r"train.report_to: 'tensorbored' is not one of accelerate's trackers \(aim, "):
        trackers(TrainSection(report_to=["tensorbored"]))


MISSING = [name for name in ("aim", "mlflow", "comet_ml", "clearml", "dvclive", "swanlab")
           if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(not MISSING, reason="every tracker this test could name is installed here")
def test_a_tracker_that_is_not_installed_is_refused_before_any_work(teacher_dir, tmp_path, capsys):
    name = MISSING[0]
    code = cli_main(["distill", "--set", f"model.teacher={teacher_dir}", "--set", f"train.report_to=[{name}]",
                     "--out", str(tmp_path / "run")])
    assert code == 2
    package = name.replace("_", "-")
    assert f"train.report_to: {name} is not installed (pip install {package}); installed: " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the teacher, the data or any folder


def test_a_wandb_run_in_offline_mode_gets_every_stage_metric_and_the_recipe(teacher_dir, tmp_path, monkeypatch):
    """train.report_to: [wandb] with WANDB_MODE=offline (what a user without network sets): no login, the run
    written under WANDB_DIR for a later `wandb sync`; its history gets the stages' metrics at one increasing step
    and its config the recipe. (The run file is wandb's binary log: the calls into it are what is checked.)"""
    wandb = pytest.importorskip("wandb")
    from wandb.sdk.wandb_run import Run

    wandb.teardown()  # settings an earlier wandb call in this process left behind

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, runs, log = [], [], Run.log

    def spy(run, data, step=None, *args, **kwargs):
        logged.append((step, dict(data)))
        runs.append(run)
        return log(run, data, step, *args, **kwargs)

    monkeypatch.setattr(Run, "log", spy)
    distill(small(teacher_dir, tmp_path / "tracked", "train.report_to=[wandb]", "stage2.steps=3",
                  "output.log_every=1"), progress=False)
    losses = [(step, data["stage2/loss"]) for step, data in logged if "stage2/loss" in data]
    assert [step for step, _ in losses] == sorted({step for step, _ in losses}) and len(losses) == 3
    config = dict(runs[0].config)
    assert config["stage2.steps"] == 3 and config["model.mixer"] == "gltm" and config["train.report_to"] == '["wandb"]'
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_a_tracker_that_cannot_start_is_one_line_exit_3_and_no_recipe_is_written(teacher_dir, tmp_path, monkeypatch,
                                                                                  capsys):
    """wandb without an API key (and not offline): wandb's own UsageError, a real one, becomes one line naming the
    tracker and what it needs; exit 3 (a fault outside the command, like a missing Hub token), before the teacher is
    loaded; recipe.json is not written, since the run never started."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # wandb keeps its settings process-wide: an earlier test's offline mode would carry over
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    out = tmp_path / "run"
    code = cli_main(["distill", "--set", f"model.teacher={teacher_dir}", "--set", "model.mixer=gltm",
                     "--set", "data.sequence_length=32", "--set", "data.max_train_sequences=4",
                     "--set", "stage1.enabled=false", "--set", "stage2.steps=1", "--set", "train.report_to=[wandb]",
                     "--out", str(out)])
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-mixers distill: error:")]
    assert code == 3 and len(error) == 1, error
    assert "train.report_to: wandb could not start (" in error[0] and "WANDB_MODE=offline" in error[0], error
    assert "half-written" not in error[0] and not (out / "recipe.json").exists()
    assert not out.exists()  # it fails before the data is packed or the student converted: nothing was made


def test_no_tracker_writes_no_events(teacher_dir, tmp_path):
    distill(small(teacher_dir, tmp_path / "quiet", "train.report_to=[]"), progress=False)
    assert not (tmp_path / "quiet" / "tensorboard").exists() and (tmp_path / "quiet" / "metrics.jsonl").exists()


def test_verbose_lets_info_lines_through(monkeypatch):
    """Warnings and errors by default; --verbose adds the info lines of hf-mixers, accelerate and transformers."""
    from transformers.utils import logging as transformers_logging

    previous = {name: logging.getLogger(name).level for name in ("hf_mixers", "accelerate")}
    transformers_level = transformers_logging.get_verbosity()
    try:
        configure_logging(False)
        assert logging.getLogger("hf_mixers.recipes").getEffectiveLevel() == logging.WARNING
        configure_logging(True)
        assert logging.getLogger("hf_mixers.recipes").getEffectiveLevel() == logging.INFO
        assert transformers_logging.get_verbosity() == logging.INFO
    finally:
        for name, level in previous.items():
            logging.getLogger(name).setLevel(level)
        transformers_logging.set_verbosity(transformers_level)
