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


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_tracker_that_is_not_installed_is_refused_before_any_work(teacher_dir, tmp_path, capsys):
    code = cli_main(["distill", "--set", f"model.teacher={teacher_dir}", "--set", "train.report_to=[wandb]",
                     "--out", str(tmp_path / "run")])
    assert code == 2
    assert "train.report_to: wandb is not installed (pip install wandb); installed: " in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the teacher, the data or any folder


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
