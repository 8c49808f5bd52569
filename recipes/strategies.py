"""How the processes of a run share the training of one stage (``train.strategy``), behind one interface.

    LocalOptimizer       ddp (and one process): AdamW here; with several processes the gradients are averaged
    DeepSpeedOptimizer   DeepSpeed ZeRO-1/2 of the trainable tensors, or ZeRO-3 of the whole student
    FSDPOptimizer        PyTorch FSDP2 (fully_shard) of the whole student, frozen weights included

Each has ``loss(batch)``, ``set_lr``, ``zero_grad``, ``backward``, ``step``, ``save``, ``load``, ``finish`` and
``path``; ``run_stage`` (recipes/trainer.py) drives them. fsdp and ZeRO-3 shard the model described by a
``Sharding`` for the stage; ``finish`` gathers the trained weights and makes the model object whole again, so
evaluation, LoRA merging and ``save_model`` work as after a ddp run.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from safetensors import safe_open
from safetensors.torch import save_file

from ..common.files import write_atomically

if TYPE_CHECKING:
    from .trainer import Processes


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names its path and what to do."""


def previous_checkpoint(path: str) -> str:
    return path.removesuffix(".safetensors") + ".previous.safetensors"


def save_checkpoint(path: str, step: int, history: list, parameters: dict, optimizer) -> None:
    """Tensors (trained parameters, optimizer states) as safetensors, everything else as JSON in its metadata: a
    checkpoint is read without unpickling anything. The checkpoint it replaces is kept as ``.previous``."""
    state = optimizer.state_dict()
    tensors = {f"parameter/{name}": tensor.detach().cpu().contiguous().clone() for name, tensor in parameters.items()}
    values = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = value.detach().cpu().contiguous().clone()
            else:
                values.setdefault(str(index), {})[key] = value
    meta = {"format": 1, "step": step, "history": history, "param_groups": state["param_groups"], "state": values}
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


@dataclass
class Sharding:
    """What ``train.strategy: fsdp`` and DeepSpeed ZeRO-3 partition for one stage (``stages.sharding_for``).

    ``model``   the module the stage trains (the names of ``parameters`` are its names); sharded in place for the
                stage, whole again with the trained weights when it ends
    ``units``   the modules the loss runs, each an FSDP unit gathering all of its parameters for its forward: the
                decoder blocks (stage 1: the converted mixers, which its loss calls on the teacher's inputs)
    ``blocks``  the decoder blocks, then ``root`` (the transformers model, when the loss runs it): FSDP shards
                each one that is not a unit already, so MLPs, and with the root embeddings and head, are sharded too

    ZeRO-3 partitions all of ``model`` and gathers it module by module, whatever units, blocks and root say.
    """
    model: nn.Module
    units: list
    blocks: list
    root: nn.Module | None


def _strategy_name(train) -> str:
    return "train.strategy=fsdp" if train.strategy == "fsdp" else "train.strategy=deepspeed with train.zero_stage=3"


# what `accelerate launch` tells its processes when its config turns on one of its own sharding plugins
ACCELERATE_PLUGINS = {"ACCELERATE_USE_FSDP": ("fsdp", "recipes/fsdp.yaml"),
                      "ACCELERATE_USE_DEEPSPEED": ("deepspeed", "recipes/zero2.yaml or recipes/zero3.yaml")}


def check_launch(train) -> None:
    """Fail before any work when the launch and the recipe disagree: the recipe shards the model but no process
    group exists (a plain ``python``), or an accelerate config asked for FSDP / DeepSpeed, which the trainer would
    not see (it shards by the recipe's ``train.strategy``; accelerate's plugins act only through ``prepare``)."""
    from .config import shards_the_model

    for variable, (strategy, overlay) in ACCELERATE_PLUGINS.items():
        if os.environ.get(variable, "").lower() in ("1", "true") and train.strategy != strategy:
            raise ValueError(f"the accelerate config of this launch turns on {strategy} ({variable}), but the recipe "
                             f"has train.strategy={train.strategy}: the trainer shards by the recipe, not by "
                             f"accelerate's plugin. Stack {overlay} on the recipe and launch with "
                             "recipes/launch/multi_gpu.yaml")
    if shards_the_model(train) and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"{_strategy_name(train)} shards the student over the processes of a torchrun / accelerate "
                         "launch, but this is one plain process: launch it with torchrun, or use train.strategy=ddp")


def _sharded_model(sharding: Sharding | None, train) -> nn.Module:
    check_launch(train)
    if sharding is None:
        raise ValueError(f"{_strategy_name(train)} shards the model, but this stage does not say how "
                         "(run_stage(sharding=...)); use train.strategy=ddp")
    return sharding.model


def _meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory; tied weights stay one parameter),
    made before sharding changes the model: the plain module the gathered weights go back into."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def _restore_whole(model: nn.Module, skeleton: nn.Module, full: dict) -> None:
    """Make ``model`` a plain module again holding ``full`` (name -> gathered tensor). The object keeps its identity
    (the caller's variables and loss closures stay valid): its contents become the skeleton's, which carries no
    FSDP / ZeRO-3 state or hooks (those live in the sharded module's ``__dict__`` and class)."""
    for name, parameter in skeleton.named_parameters():  # a tied weight once: every module holding it sees it
        # swapped in place (a meta tensor's .data cannot be set to a real one)
        torch.utils.swap_tensors(parameter, nn.Parameter(full[name], requires_grad=parameter.requires_grad))
    model.__class__ = skeleton.__class__
    model.__dict__ = skeleton.__dict__


def _report_sharding(path: str, processes, what: str, stored: int, total: int) -> None:
    if processes.is_main:
        stage = os.path.basename(path).removesuffix(".safetensors")
        tqdm.write(f"{stage}: {what}: the student's {total / 1e6:.2f}M parameters sharded over {processes.world} "
                   f"processes; this rank stores {stored / total:.1%} of them")


def _clip_gradients(parameters, max_norm: float) -> None:
    """Clip by the global gradient norm. FSDP's gradients are DTensor shards: their norm is a partial value per
    rank until reduced over the processes (``full_tensor``); plain tensors go through unchanged."""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)


class LocalOptimizer:
    """AdamW on this process; with several processes the gradients are averaged first (data parallelism).

    The interface every strategy has: ``loss(batch)`` (the stage's loss, through whatever wraps the model),
    ``set_lr``, ``zero_grad``, ``backward``, ``step``, ``save``, ``load``, ``finish`` (after the last step: the
    model whole again) and ``path`` (where the checkpoint lives)."""

    def __init__(self, parameters: dict, train, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None):
        self.parameters, self.train, self.processes, self.path = parameters, train, processes, path
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.AdamW(list(parameters.values()), lr=lr, weight_decay=train.weight_decay)

    def loss(self, batch):
        return self.loss_fn(batch)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss) -> None:
        (loss / self.train.grad_accum).backward()

    def reduce_gradients(self) -> None:
        self.processes.average_gradients(self.parameters.values())

    def step(self) -> None:
        self.reduce_gradients()
        if self.train.max_grad_norm:
            _clip_gradients(self.parameters.values(), self.train.max_grad_norm)
        self.optimizer.step()

    def save(self, step: int, history: list) -> None:
        if self.processes.is_main:
            save_checkpoint(self.path, step, history, self.parameters, self.optimizer)
        self.processes.barrier()

    def load(self):
        """(step, history) of the checkpoint, restored into the parameters and optimizer; None if there is none."""
        loaded = load_checkpoint(self.path)
        if loaded is None:
            return None
        tensors, meta = loaded
        missing = sorted(set(self.parameters) - {key.removeprefix("parameter/") for key in tensors})
        if missing:
            raise CheckpointError(f"{self.path}: checkpoint does not match this run (no {missing[:3]}); "
                                  "use another output.dir")
        with torch.no_grad():
            for name, tensor in self.parameters.items():
                tensor.copy_(tensors[f"parameter/{name}"])
        state = {int(index): dict(values) for index, values in meta["state"].items()}
        for key, tensor in tensors.items():
            if key.startswith("optimizer/"):
                _, index, name = key.split("/", 2)
                state.setdefault(int(index), {})[name] = tensor
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        return meta["step"], meta["history"]

    def finish(self) -> None:
        pass  # the model was trained in place


class FSDPOptimizer(LocalOptimizer):
    """PyTorch FSDP2 (``train.strategy: fsdp``): every weight of the student, frozen ones included, sharded over
    the processes (``fully_shard`` on each unit, each decoder block, then the root); gathered for a unit's forward
    and backward, gradients reduce-scattered; AdamW over the sharded trainable parameters. Checkpoints: the
    trainable parameters and optimizer states, each rank its own shards (torch.distributed.checkpoint), in
    ``checkpoints/<stage>-fsdp/step<N>/``, named in ``latest`` once complete."""

    def __init__(self, parameters: dict, train, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = _sharded_model(sharding, train)
        self.model, self.skeleton = model, _meta_skeleton(model)
        mesh = init_device_mesh(processes.accelerator.device.type, (processes.world,))
        done = set()
        root = [sharding.root] if sharding.root is not None else []
        for module in [*sharding.units, *sharding.blocks, *root]:  # inner units first, the root last
            if id(module) not in done:
                done.add(id(module))
                fully_shard(module, mesh=mesh)
        # fully_shard replaced every parameter by a DTensor shard: the optimizer takes those, by name
        sharded = {name: p for name, p in model.named_parameters() if name in parameters}
        outside = sorted(name for name in parameters if not isinstance(sharded.get(name), DTensor))
        if outside:
            raise ValueError(f"train.strategy=fsdp: trainable parameters outside every sharded module: {outside[:3]}")
        super().__init__(sharded, train, lr, processes, path, loss_fn)
        self.path = path.removesuffix(".safetensors") + "-fsdp"
        stored = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        _report_sharding(path, processes, "fsdp", stored, sum(p.numel() for p in model.parameters()))

    def reduce_gradients(self) -> None:
        pass  # reduce-scattered (averaged) by FSDP during backward

    def _state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # the trainable parameters only: frozen weights never change and come from the model as built
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_state, "optimizer": optimizer_state}, options

    def save(self, step: int, history: list) -> None:
        import torch.distributed.checkpoint as dcp

        folder = os.path.join(self.path, f"step{step}")
        if self.processes.is_main and os.path.isdir(folder):
            shutil.rmtree(folder)  # a killed run's incomplete attempt at this step
        self.processes.barrier()
        state, _ = self._state()
        dcp.save(state, checkpoint_id=folder)  # every rank writes its shards
        self.processes.barrier()
        if self.processes.is_main:
            with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as handle:
                json.dump({"step": step, "history": history}, handle)
            write_atomically(os.path.join(self.path, "latest"), f"step{step}")  # the completion marker
            for name in os.listdir(self.path):  # earlier checkpoints are superseded
                if name.startswith("step") and name != f"step{step}":
                    shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        self.processes.barrier()

    def load(self):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        marker = os.path.join(self.path, "latest")
        if not os.path.exists(marker):
            return None
        with open(marker, encoding="utf-8") as handle:
            folder = os.path.join(self.path, handle.read().strip())
        state, options = self._state()
        try:
            dcp.load(state, checkpoint_id=folder)
        except Exception as error:  # DCP wraps every rank's failure; say which checkpoint and what to do
            raise ValueError(f"{folder}: checkpoint does not match this run ({error}); use another output.dir") \
                from error
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as handle:
            client = json.load(handle)
        return client["step"], client["history"]

    def finish(self) -> None:
        from torch.distributed.tensor import DTensor

        full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()  # all-gathered on every rank
                for name, p in self.model.named_parameters()}
        _restore_whole(self.model, self.skeleton, full)


class _LossModule(nn.Module):
    """What DeepSpeed's engine wraps: its forward is the stage's loss, so the loss runs through the engine (which
    sets up ZeRO's backward bookkeeping); it holds the tensors DeepSpeed manages."""

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(batch)


class DeepSpeedOptimizer:
    """DeepSpeed ZeRO (``train.strategy: deepspeed``): optimizer states (stage 1) and gradients (stage 2) of the
    trainable parameters partitioned over the processes; with stage 3 the whole student too (frozen weights
    included), gathered module by module for the forward and backward and gathered whole when the stage ends.
    DeepSpeed's own per-rank checkpoints under ``checkpoints/<stage>-deepspeed``."""

    def __init__(self, parameters: dict, train, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None):
        import deepspeed

        self.path = path.removesuffix(".safetensors") + "-deepspeed"
        self.zero3 = train.zero_stage == 3
        holder = _LossModule(loss_fn)
        zero = {"stage": train.zero_stage}
        if self.zero3:
            self.model = _sharded_model(sharding, train)
            self.skeleton = _meta_skeleton(self.model)
            # registered: ZeRO-3 partitions every parameter of the student and hooks every submodule, each gathering
            # its own parameters for its forward and backward (weights read outside their module's forward, like
            # RSA's inter-level MLPs, are found by ZeRO-3's external-parameter discovery during the engine's forward)
            holder.model = self.model
            hidden = getattr(self.model.config, "hidden_size", None)
            if hidden:  # transformers' "auto" value: tensors smaller than this (norms, biases) stay whole
                zero["stage3_param_persistence_threshold"] = 10 * hidden
        else:
            holder.trained = nn.ParameterList(list(parameters.values()))  # frozen weights stay outside DeepSpeed
        config = {"train_micro_batch_size_per_gpu": train.batch_size,
                  "gradient_accumulation_steps": train.grad_accum,
                  "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": train.weight_decay,
                                                            "torch_adam": True}},
                  "gradient_clipping": train.max_grad_norm or 0.0, "steps_per_print": 10**9}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=holder, model_parameters=list(parameters.values()), config=config)
        if self.zero3:  # at rest a partitioned tensor's data is empty; a persistent one keeps it whole as well
            stored = sum(p.ds_tensor.numel() + p.numel() for p in self.model.parameters())
            total = sum(p.ds_numel for p in self.model.parameters())
            _report_sharding(path, processes, "deepspeed ZeRO-3", stored, total)

    def loss(self, batch):
        return self.engine(batch)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        pass  # the engine zeroes after each optimizer step

    def backward(self, loss) -> None:
        self.engine.backward(loss)
        self.engine.step()  # a no-op except at the gradient-accumulation boundary

    def step(self) -> None:
        pass

    def save(self, step: int, history: list) -> None:
        # every rank writes its partition; DeepSpeed updates the 'latest' pointer only when all are written
        self.engine.save_checkpoint(self.path, tag=f"step{step}", client_state={"step": step, "history": history})

    def load(self):
        if not os.path.exists(os.path.join(self.path, "latest")):
            return None
        _, client = self.engine.load_checkpoint(self.path)
        return client["step"], client["history"]

    def finish(self) -> None:
        if not self.zero3:
            return  # ZeRO-1/2 trained the model's own tensors in place
        import deepspeed

        full = {}
        for name, parameter in self.model.named_parameters():  # one tensor at a time: the peak stays one model
            with deepspeed.zero.GatheredParameters([parameter]):
                full[name] = parameter.detach().clone()
        self.engine.destroy()  # its hooks and partitions go with the sharded modules
        _restore_whole(self.model, self.skeleton, full)


STRATEGIES = {"ddp": LocalOptimizer, "deepspeed": DeepSpeedOptimizer, "fsdp": FSDPOptimizer}
