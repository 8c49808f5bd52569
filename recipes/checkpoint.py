"""The training checkpoint, one format for every strategy (recipes/strategies.py): the trainable tensors whole,
by name, and the optimizer state by parameter name, in one safetensors file beside its previous one, written
atomically; a checkpoint of another run, or in the pickled format of earlier versions, is refused by name."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..common.files import write_atomically


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names its path and what to do."""


def previous_checkpoint(path: str) -> str:
    return path.removesuffix(".safetensors") + ".previous.safetensors"


def save_checkpoint(path: str, step: int, history: list, parameters: dict, optimizer_state: dict,
                    loss_scaler: dict | None = None) -> None:
    """One checkpoint format for every strategy: ``parameters`` (name -> whole tensor) and ``optimizer_state``
    (torch's optimizer ``state_dict`` layout, states indexed by the parameters' order) as safetensors, everything else
    as JSON in its metadata (``loss_scaler``: an fp16 run's scale, its clean steps since the last overflow, and the
    scaler's own state under "torch" or "deepspeed"), so a checkpoint is read without unpickling anything and
    resumes under any strategy and process count. The checkpoint it replaces is kept as ``.previous``."""
    tensors = {f"parameter/{name}": tensor.detach().cpu().contiguous().clone() for name, tensor in parameters.items()}
    values = {}
    for index, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value.detach().cpu().contiguous().clone()
            else:
                values.setdefault(str(index), {})[key] = value
    meta = {"format": 1, "step": step, "history": history, "param_groups": optimizer_state["param_groups"],
            "state": values}
    if loss_scaler is not None:
        meta["loss_scaler"] = loss_scaler
    if os.path.exists(path):
        os.replace(path, previous_checkpoint(path))  # the last good one, until this one is complete
    write_atomically(path, lambda temporary: save_file(tensors, temporary, metadata={"hf_mixers": json.dumps(meta)}))


def _read_checkpoint(path: str) -> tuple[dict, dict]:
    with safe_open(path, framework="pt") as handle:
        meta = json.loads((handle.metadata() or {})["hf_mixers"])
        return {key: handle.get_tensor(key) for key in handle.keys()}, meta


def load_checkpoint(path: str):
    """(tensors, meta) of the checkpoint at ``path``; its ``.previous`` when a save was killed before completing;
    None when there is neither. A checkpoint that cannot be read is a CheckpointError naming it and the way out."""
    _refuse_pickled_checkpoints(path)
    previous = previous_checkpoint(path)
    if not os.path.exists(path):
        path = previous if os.path.exists(previous) else None
        if path is None:
            return None
    try:
        return _read_checkpoint(path)
    except Exception as error:  # truncated, corrupted, or not a checkpoint of this format
        advice = "start the stage over in a new output.dir (or delete the file)"
        if path != previous and os.path.exists(previous):
            try:
                step = _read_checkpoint(previous)[1]["step"]
                advice = (f"the previous checkpoint {previous} (step {step}) is intact: delete {path} to resume from "
                          f"it, or {advice}")
            except Exception:
                pass
        raise CheckpointError(f"{path}: the checkpoint cannot be read ({type(error).__name__}: {error}); "
                              f"{advice}") from None


def _refuse_pickled_checkpoints(path: str) -> None:
    """Before this format, deepspeed and fsdp kept their libraries' checkpoints (``<stage>-deepspeed/``,
    ``<stage>-fsdp/``), which are unpickled on load: never read, never silently restarted over."""
    for suffix in ("-deepspeed", "-fsdp"):
        folder = path.removesuffix(".safetensors") + suffix
        if os.path.isdir(folder) and not os.path.exists(path) and not os.path.exists(previous_checkpoint(path)):
            raise CheckpointError(f"{folder}: a checkpoint in the pickled format of earlier versions, which is no "
                                  "longer read (loading it could run code stored in it); start the stage over in a "
                                  "new output.dir, or delete the folder")


def load_training_state(path: str, names: list[str]):
    """(parameters, optimizer_state, step, history, loss_scaler) of the checkpoint at ``path`` for a run training
    ``names`` (the layout ``save_checkpoint`` takes; ``loss_scaler`` None unless an fp16 run saved it); None when
    there is no checkpoint."""
    loaded = load_checkpoint(path)
    if loaded is None:
        return None
    tensors, meta = loaded
    missing = [name for name in names if f"parameter/{name}" not in tensors]
    if missing or len(names) != sum(key.startswith("parameter/") for key in tensors):
        raise CheckpointError(f"{path}: checkpoint does not match this run (it trains other tensors"
                              f"{': no ' + str(missing[:3]) if missing else ''}); use another output.dir")
    parameters = {name: tensors[f"parameter/{name}"] for name in names}
    state = {int(index): dict(values) for index, values in meta["state"].items()}
    for key, tensor in tensors.items():
        if key.startswith("optimizer/"):
            _, index, name = key.split("/", 2)
            state.setdefault(int(index), {})[name] = tensor
    return (parameters, {"state": state, "param_groups": meta["param_groups"]}, meta["step"], meta["history"],
            meta.get("loss_scaler"))


def optimizer_state_by_name(optimizer_state: dict, names: list[str]) -> dict:
    """An optimizer state indexed by parameter position, keyed by parameter name instead (and back:
    ``optimizer_state_by_index``), the layout torch.distributed.checkpoint.state_dict uses."""
    return {"state": {names[index]: values for index, values in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in optimizer_state["param_groups"]]}


def optimizer_state_by_index(optimizer_state: dict, names: list[str]) -> dict:
    position = {name: index for index, name in enumerate(names)}
    return {"state": {position[name]: values for name, values in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                             for group in optimizer_state["param_groups"]]}
