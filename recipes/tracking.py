"""Experiment trackers (``train.report_to``) through accelerate's: TensorBoard, Weights & Biases, MLflow, Aim, ...

    accelerator = Accelerator(log_with=trackers(train), project_dir=OUT/tensorboard)   # stages.launched
    start_tracking(processes, recipe)        # once a run: the recipe as the run's configuration
    processes.log({"stage2/loss": ...}, step) # rank 0 only (accelerate's trackers live on the main process)
    finish_tracking(processes)               # (accelerate's end_training would also end the process group)

``report_to`` names accelerate's trackers (``tensorboard``, ``wandb``, ``mlflow``, ``aim``, ``comet_ml``, ...), or
``all`` (every one installed), or nothing. A named tracker that is not installed is refused before any work, with
the package to install. Each tracker keeps its own settings: WANDB_MODE=offline, MLFLOW_TRACKING_URI, ... are read
by the tracker, not here. TensorBoard writes under ``OUT/tensorboard``. A run logs one increasing step across its
stages (run_stage's ``log_offset``: the steps of the stages before), as wandb requires.
"""

from __future__ import annotations

import json
import os

from .config import flatten

PROJECT = "hf-mixers"


def trackers(train) -> list[str]:
    """accelerate's ``log_with`` for ``train.report_to``: the named trackers, each checked to be installed."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    available = {str(getattr(tracker, "value", tracker)) for tracker in get_available_trackers()}
    names = list(train.report_to)
    if "all" in names:
        return sorted(available)
    known = {kind.value for kind in LoggerType}
    for name in names:
        if name not in known:
            raise ValueError(f"train.report_to: {name!r} is not one of accelerate's trackers "
                             f"({', '.join(sorted(known))})")
        if name not in available:
            raise ValueError(f"train.report_to: {name} is not installed (pip install {name.replace('_', '-')}); "
                             f"installed: {', '.join(sorted(available)) or 'none'}")
    return names


class TrackerError(ConnectionError):
    """A tracker of ``train.report_to`` that cannot start (no credentials, no server): a fault outside the command,
    reported in one line (exit 3)."""


def start_tracking(processes, recipe) -> None:
    """The run's trackers, named after its output folder, with the recipe (dotted keys; lists and mappings as JSON
    text) as their configuration. One that cannot start is a ``TrackerError`` naming it and what it needs."""
    accelerator = processes.accelerator
    if accelerator is None or not accelerator.log_with:
        return
    config = {key: value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
              for key, value in flatten(recipe.to_dict()).items()}
    run_name = os.path.basename(os.path.normpath(recipe.output.dir))
    try:
        accelerator.init_trackers(PROJECT, config=config, init_kwargs={"wandb": {"name": run_name}})
    except Exception as error:  # noqa: BLE001 - each tracker raises its own kinds; all are the same fault here
        names = ", ".join(str(getattr(kind, "value", kind)) for kind in accelerator.log_with)
        if isinstance(error, OSError) and error.errno is not None:  # its folder cannot be written: the machine's
            raise OSError(error.errno, f"train.report_to: {names} could not write its logs ({error.strerror})",
                          accelerator.project_dir) from error
        cause = (str(error).strip().splitlines() or [""])[0]
        raise TrackerError(f"train.report_to: {names} could not start ({type(error).__name__}: {cause}); give the "
                           "tracker what it needs (e.g. WANDB_API_KEY, or WANDB_MODE=offline; "
                           "MLFLOW_TRACKING_URI), or leave it out of train.report_to") from error


def finish_tracking(processes) -> None:
    """Close the run's trackers (their files flushed, a wandb run marked finished)."""
    for tracker in getattr(processes.accelerator, "trackers", []):
        tracker.finish()
