"""How the processes of a run share the training of one stage (``train.strategy``), behind one interface.

    LocalStrategy        ddp (and one process): AdamW here; with several processes DistributedDataParallel
    DeepSpeedStrategy    DeepSpeed ZeRO-1/2 of the trainable tensors, or ZeRO-3 of the whole student
    FSDPStrategy         PyTorch FSDP2 (fully_shard) of the whole student, frozen weights included

Each has ``loss(batch)``, ``set_lr``, ``zero_grad``, ``backward``, ``step``, ``save``, ``load``, ``finish`` and
``path``; ``run_stage`` (recipes/trainer.py) drives them. fsdp and ZeRO-3 shard the model described by a
``Sharding`` for the stage; ``finish`` gathers the trained weights and makes the model object whole again, so
evaluation, LoRA merging and ``save_model`` work as after a ddp run.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from .checkpoint import load_training_state, optimizer_state_by_index, optimizer_state_by_name, save_checkpoint
from .deepspeed_config import deepspeed_settings, merged, read_deepspeed_config, zero3_settings
from .optimizers import check_optimizer, make_optimizer
from .precision import check_launch_precision, loss_scaler
from .processes import Processes
from .run_plan import RunPlan


@dataclass
class Sharding:
    """What ``train.strategy: fsdp`` and DeepSpeed ZeRO-3 partition for one stage (``stages.sharding_for``).

    ``model``   the module the stage trains (the names of ``parameters`` are its names); sharded in place for the
                stage, whole again with the trained weights when it ends
    ``units``   the modules the loss runs, each an FSDP unit gathering all of its parameters for its forward: the
                decoder blocks (stage 1: the converted mixers, which its loss calls on the teacher's inputs)
    ``blocks``  the decoder blocks, then ``root`` (the module whose forward the loss calls: the decoder when the
                student's head is the teacher's frozen tensor, read as the teacher's; else the whole causal LM): FSDP
                shards each one that is not a unit already, so MLPs, and with the root its embeddings, are sharded

    ``kept``    name -> the tensor of each frozen parameter that lives on outside ``model`` (the teacher's, shared
                with the student): sharding it frees nothing, and the stage's end puts it back rather than gathering
                a second whole copy

    ZeRO-3 partitions all of ``model`` and gathers it module by module, whatever units, blocks and root say.
    """
    model: nn.Module
    units: list
    blocks: list
    root: nn.Module | None
    kept: dict = field(default_factory=dict)


def _strategy_name(train) -> str:
    return "train.strategy=fsdp" if train.strategy == "fsdp" else "train.strategy=deepspeed with train.zero_stage=3"


# what `accelerate launch` tells its processes when its config turns on one of its own sharding plugins
ACCELERATE_PLUGINS = {"ACCELERATE_USE_FSDP": ("fsdp", "recipes/fsdp.yaml"),
                      "ACCELERATE_USE_DEEPSPEED": ("deepspeed", "recipes/zero2.yaml or recipes/zero3.yaml")}


def _turned_on(variable: str) -> bool:
    """Whether `accelerate launch` set this boolean of its config in the environment."""
    return os.environ.get(variable, "").lower() in ("1", "true")


def from_accelerate_config(train):
    """``train`` with what an accelerate config of this launch says and the recipe does not, when the two agree on
    the strategy (``check_launch`` refuses them when not): its DeepSpeed JSON (``deepspeed_config_file``) becomes
    ``train.deepspeed_config`` and is merged like one (recipes/deepspeed_config.py). What it sets that the recipe
    runs otherwise is an error naming both: another ZeRO stage, another DeepSpeed JSON, an FSDP sharding strategy
    other than full sharding, FSDP parameter offload."""
    from dataclasses import replace

    if _turned_on("ACCELERATE_USE_DEEPSPEED") and train.strategy == "deepspeed":
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if stage not in (None, "", "None") and int(stage) != train.zero_stage:
            raise ValueError(f"the accelerate config of this launch has zero_stage {stage}, the recipe "
                             f"train.zero_stage={train.zero_stage}: make them agree (recipes/zero2.yaml, zero3.yaml)")
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path not in (None, "", "none", "None"):
            if train.deepspeed_config and os.path.abspath(train.deepspeed_config) != os.path.abspath(path):
                raise ValueError(f"the accelerate config of this launch names the DeepSpeed config {path}, the recipe "
                                 f"train.deepspeed_config={train.deepspeed_config}: give one of them")
            train = replace(train, deepspeed_config=path)
    if _turned_on("ACCELERATE_USE_FSDP") and train.strategy == "fsdp":
        sharding = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
        if sharding not in ("FULL_SHARD", "1"):
            raise ValueError(f"the accelerate config of this launch asks for the FSDP sharding strategy {sharding}; "
                             "train.strategy=fsdp shards fully (FULL_SHARD): change the accelerate config, or use "
                             "train.strategy=deepspeed with train.zero_stage=2 to shard gradients and optimizer states")
        if _turned_on("FSDP_OFFLOAD_PARAMS"):
            raise ValueError("the accelerate config of this launch offloads FSDP parameters to the CPU "
                             "(fsdp_offload_params), which train.strategy=fsdp does not do: turn it off")
    return train


def check_launch(train) -> None:
    """Fail before any work when the launch and the recipe disagree: the recipe shards the model but no process
    group exists (a plain ``python``), an accelerate config asked for FSDP / DeepSpeed, which the trainer would
    not see (it shards by the recipe's ``train.strategy``; accelerate's plugins act only through ``prepare``), or
    for a mixed precision the recipe does not run (recipes/precision.py); or when ``train.optimizer`` cannot run
    here (recipes/optimizers.py)."""
    from .config import shards_the_model

    check_launch_precision(train.precision)
    check_optimizer(train)
    for variable, (strategy, overlay) in ACCELERATE_PLUGINS.items():
        if _turned_on(variable) and train.strategy != strategy:
            raise ValueError(f"the accelerate config of this launch turns on {strategy} ({variable}), but the recipe "
                             f"has train.strategy={train.strategy}: the trainer shards by the recipe, not by "
                             f"accelerate's plugin. Stack {overlay} on the recipe and launch with "
                             "recipes/launch/multi_gpu.yaml")
    if shards_the_model(train) and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"{_strategy_name(train)} shards the student over the processes of a torchrun / accelerate "
                         "launch, but this is one plain process: launch it with torchrun, or use train.strategy=ddp")
    if train.strategy == "deepspeed" and train.precision == "fp16":
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if not accelerator.is_fp16_supported():  # DeepSpeed's engine would refuse it after the models are loaded
            raise ValueError(f"train.precision=fp16 under train.strategy=deepspeed: DeepSpeed's "
                             f"{accelerator.device_name()} accelerator has no fp16 here (on a CPU it needs oneDNN's "
                             "fp16 kernels: AVX512-FP16 or AMX-FP16); use train.precision=bf16, or fp16 under "
                             "train.strategy=ddp or fsdp")


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


class LocalStrategy:
    """AdamW on this process; with several processes (``ddp``) torch's DistributedDataParallel averages the
    gradients: bucketed all-reduces that start during the backward, as soon as a bucket's gradients are ready.
    Under ``train.precision: fp16`` torch's GradScaler scales the loss, unscales the gradients before clipping and
    skips a step whose gradients overflowed (recipes/precision.py ``loss_scaler``); its state is checkpointed.

    The interface every strategy has: ``loss(batch, metrics)`` (the stage's loss, through whatever wraps the model),
    ``set_lr``, ``zero_grad``, ``backward``, ``step``, ``save``, ``load``, ``finish`` (after the last step: the
    model whole again) and ``path`` (where the checkpoint lives)."""

    def __init__(self, parameters: dict, plan: RunPlan, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None, data_parallel: bool = True):
        train = plan.train
        self.parameters, self.train, self.processes, self.path = parameters, train, processes, path
        self.loss_fn = loss_fn
        self.optimizer = make_optimizer(list(parameters.values()), train, lr)
        self.scaler = loss_scaler(plan.dtype, processes.device)
        self.ddp, self._micro = None, 0
        if data_parallel and processes.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            # DDP reduces what its module holds: the trained tensors (the frozen weights stay outside it); the loss
            # reaches them through the student the loss function closes over. It broadcasts rank 0's values first.
            holder = _LossModule(loss_fn)
            holder.trained = nn.ParameterList(list(parameters.values()))
            device = processes.device
            self.ddp = DistributedDataParallel(holder, device_ids=[device.index] if device.type == "cuda" else None,
                                               broadcast_buffers=False, find_unused_parameters=True)
            if processes.is_main:
                stage = os.path.basename(path).removesuffix(".safetensors")
                tqdm.write(f"{stage}: ddp: DistributedDataParallel over {processes.world} processes, "
                           f"{sum(p.numel() for p in parameters.values()) / 1e6:.2f}M trained parameters")

    def loss(self, batch, metrics: bool = True):
        if self.ddp is None:
            return self.loss_fn(batch, metrics)
        self._micro += 1  # gradients are all-reduced in the backward of the accumulation's last micro-batch only
        self.ddp.require_backward_grad_sync = self._micro % self.train.grad_accum == 0
        return self.ddp(batch, metrics)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0

    def backward(self, loss) -> None:
        loss = loss / self.train.grad_accum
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def reduce_gradients(self) -> None:
        pass  # DistributedDataParallel averaged them during the backward (one process: nothing to do)

    def step(self) -> None:
        self.reduce_gradients()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients; notes whether any overflowed
        if self.train.max_grad_norm:
            _clip_gradients(self.parameters.values(), self.train.max_grad_norm)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)  # skipped when a gradient overflowed
            self.scaler.update()  # halved after an overflow, doubled after growth_interval clean steps

    def loss_scale(self) -> float | None:
        """The fp16 loss scale for the next step (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.get_scale()

    def _scaler_state(self) -> dict | None:
        if self.scaler is None:
            return None
        state = self.scaler.state_dict()
        return {"scale": state["scale"], "clean_steps": state["_growth_tracker"], "torch": state}

    def _restore_scaler(self, state: dict | None) -> None:
        if self.scaler is None or state is None:  # a bf16/fp32 checkpoint: the scale starts afresh
            return
        # a DeepSpeed run's checkpoint: its scale, and the clean steps towards the next growth
        self.scaler.load_state_dict(state.get("torch") or {**self.scaler.state_dict(), "scale": state["scale"],
                                                           "_growth_tracker": state["clean_steps"]})

    def save(self, step: int, history: list) -> None:
        if self.processes.is_main:
            save_checkpoint(self.path, step, history, self.parameters, self.optimizer.state_dict(),
                            self._scaler_state())
        self.processes.barrier()

    def load(self):
        """(step, history) of the checkpoint, restored into the parameters and optimizer; None if there is none."""
        loaded = load_training_state(self.path, list(self.parameters))
        if loaded is None:
            return None
        parameters, optimizer_state, step, history, scaler = loaded
        with torch.no_grad():
            for name, tensor in self.parameters.items():
                tensor.copy_(parameters[name])
        self.optimizer.load_state_dict(optimizer_state)
        self._restore_scaler(scaler)
        return step, history

    def finish(self) -> None:
        pass  # the model was trained in place


class FSDPStrategy(LocalStrategy):
    """PyTorch FSDP2 (``train.strategy: fsdp``): every weight of the student, frozen ones included, sharded over
    the processes (``fully_shard`` on each unit, each decoder block, then the root); gathered for a unit's forward
    and backward, gradients reduce-scattered; AdamW over the sharded trainable parameters. Checkpoints: the
    trainable parameters and optimizer states gathered whole to rank 0, in the one format (``save_checkpoint``)."""

    def __init__(self, parameters: dict, plan: RunPlan, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = _sharded_model(sharding, plan.train)
        scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
        if scalars:  # FSDP2 shards along dimension 0
            raise ValueError(f"train.strategy=fsdp cannot shard scalar parameters ({', '.join(scalars[:3])}"
                             f"{', ...' if len(scalars) > 3 else ''}: Sessa's gamma_bias); use "
                             "train.strategy=deepspeed with train.zero_stage=3 to shard this student, or ddp")
        self.model, self.skeleton, self.kept = model, _meta_skeleton(model), sharding.kept
        device = processes.device
        mesh = init_device_mesh(device.type, (processes.world,))
        done, root = set(), [sharding.root] if sharding.root is not None else []
        policy = _fsdp_precision(plan.dtype)
        for module in [*sharding.units, *sharding.blocks, *root]:  # inner units first, the root last
            if id(module) not in done:
                done.add(id(module))
                fully_shard(module, mesh=mesh, mp_policy=policy)
        # fully_shard replaced every parameter by a DTensor shard: the optimizer takes those, by name
        sharded = {name: p for name, p in model.named_parameters() if name in parameters}
        outside = sorted(name for name in parameters if not isinstance(sharded.get(name), DTensor))
        if outside:
            raise ValueError(f"train.strategy=fsdp: trainable parameters outside every sharded module: {outside[:3]}")
        super().__init__(sharded, plan, lr, processes, path, loss_fn, data_parallel=False)  # FSDP reduces
        stored = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        _report_sharding(path, processes, "fsdp", stored, sum(p.numel() for p in model.parameters()))

    def reduce_gradients(self) -> None:
        pass  # reduce-scattered (averaged) by FSDP during backward

    def _options(self, **extra):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # whole tensors, of the trainable parameters only: frozen weights never change and come from the model as built
        return StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False, **extra)

    def save(self, step: int, history: list) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # every rank takes part in gathering the shards; rank 0 receives the whole tensors, on CPU
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer,
                                                      options=self._options(cpu_offload=True))
        if self.processes.is_main:
            names = list(self.parameters)
            save_checkpoint(self.path, step, history, {name: model_state[name] for name in names},
                            optimizer_state_by_index(optimizer_state, names), self._scaler_state())
        self.processes.barrier()

    def load(self):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        names = list(self.parameters)
        loaded = load_training_state(self.path, names)  # every rank reads the whole checkpoint, keeps its shards
        if loaded is None:
            return None
        parameters, optimizer_state, step, history, scaler = loaded
        set_state_dict(self.model, self.optimizer, model_state_dict=parameters,
                       optim_state_dict=optimizer_state_by_name(optimizer_state, names), options=self._options())
        self._restore_scaler(scaler)
        return step, history

    def finish(self) -> None:
        from torch.distributed.tensor import DTensor

        full = {name: self.kept[name] if name in self.kept else  # the same names on every rank: gathers stay paired
                (p.full_tensor() if isinstance(p, DTensor) else p).detach()  # all-gathered on every rank
                for name, p in self.model.named_parameters()}
        _restore_whole(self.model, self.skeleton, full)


def _fsdp_precision(dtype: torch.dtype):
    """FSDP2's MixedPrecisionPolicy for ``train.precision``: under bf16 (fp16) every unit is gathered in bf16 (fp16;
    the frozen weights are in it already, the fp32 trained shards are cast for the forward) and gradients are
    reduce-scattered and kept in fp32, the masters' dtype; fp32: the default policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class _LossModule(nn.Module):
    """What DeepSpeed's engine wraps: its forward is the stage's loss, so the loss runs through the engine (which
    sets up ZeRO's backward bookkeeping); it holds the tensors DeepSpeed manages."""

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, batch, metrics: bool = True):
        return self.loss_fn(batch, metrics)


def _one_process_group(device: torch.device) -> None:
    """A process group of this one process, where no launcher made one (plain ``python``/``hf-mixers``): DeepSpeed
    would otherwise look for an MPI launcher to learn its rank and fail without mpi4py. An in-process store, so no
    port or file is taken; the variables a launcher sets (DeepSpeed's engine reads LOCAL_RANK) say rank 0 of 1."""
    if torch.distributed.is_initialized():
        return
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         store=torch.distributed.HashStore(), rank=0, world_size=1)


class DeepSpeedStrategy:
    """DeepSpeed ZeRO (``train.strategy: deepspeed``): optimizer states (stage 1) and gradients (stage 2) of the
    trainable parameters partitioned over the processes; with stage 3 the whole student too (frozen weights
    included), gathered module by module for the forward and backward and gathered whole when the stage ends.
    Checkpoints: the trainable parameters and their Adam states gathered whole (DeepSpeed's ``safe_get_full_*``),
    in the one format (``save_checkpoint``), not DeepSpeed's own pickled files. Under fp16 DeepSpeed scales the
    loss itself (its ``fp16`` block, dynamic); its scaler's counters go into the checkpoint."""

    SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")  # DynamicLossScaler's state

    def __init__(self, parameters: dict, plan: RunPlan, lr: float, processes: Processes, path: str, loss_fn,
                 sharding: Sharding | None = None):
        import deepspeed

        train, dtype = plan.train, plan.dtype
        self.processes, self.parameters, self.path = processes, parameters, path
        self.zero3 = train.zero_stage == 3
        self.fp16 = dtype == torch.float16
        holder = _LossModule(loss_fn)
        config = deepspeed_settings(train, lr, dtype)
        if self.zero3:
            self.model = _sharded_model(sharding, train)
            self.skeleton, self.kept = _meta_skeleton(self.model), sharding.kept
            # registered: ZeRO-3 partitions every parameter of the student and hooks every submodule, each gathering
            # its own parameters for its forward and backward (weights read outside their module's forward, like
            # RSA's inter-level MLPs, are found by ZeRO-3's external-parameter discovery during the engine's forward)
            holder.model = self.model
            hidden = getattr(self.model.config, "hidden_size", None)
            blocks = [block for block in sharding.blocks if block is not sharding.root]
            if hidden and blocks:
                largest = max(sum(getattr(p, "ds_numel", p.numel()) for p in block.parameters())
                              for block in blocks)
                config["zero_optimization"].update(zero3_settings(hidden, largest))
        else:
            holder.trained = nn.ParameterList(list(parameters.values()))  # frozen weights stay outside DeepSpeed
        if train.deepspeed_config:  # the user's JSON, merged: its own keys kept, the recipe's checked
            user = read_deepspeed_config(train.deepspeed_config)
            config = merged(user, config, train.deepspeed_config)
            if processes.is_main:
                stage = os.path.basename(path).removesuffix(".safetensors")
                tqdm.write(f"{stage}: deepspeed: {train.deepspeed_config} merged into the recipe's settings")
        _one_process_group(processes.device)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=holder, model_parameters=list(parameters.values()), config=config)
        if self.zero3:  # at rest a partitioned tensor's data is empty; a persistent one keeps it whole as well
            stored = sum(p.ds_tensor.numel() + p.numel() for p in self.model.parameters())
            total = sum(p.ds_numel for p in self.model.parameters())
            _report_sharding(path, processes, "deepspeed ZeRO-3", stored, total)

    def loss(self, batch, metrics: bool = True):
        return self.engine(batch, metrics)

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

    def loss_scale(self) -> float | None:
        return float(self.optimizer.loss_scaler.cur_scale) if self.fp16 else None

    def _scaler_state(self) -> dict | None:
        if not self.fp16:
            return None
        scaler = self.optimizer.loss_scaler
        return {"scale": float(scaler.cur_scale), "clean_steps": scaler.cur_iter - scaler.last_overflow_iter - 1,
                "deepspeed": {key: getattr(scaler, key) for key in self.SCALER_FIELDS}}

    def _restore_scaler(self, state: dict | None) -> None:
        if not self.fp16 or state is None:
            return
        scaler = self.optimizer.loss_scaler
        if "deepspeed" in state:
            for key, value in state["deepspeed"].items():
                setattr(scaler, key, value)
        else:  # a checkpoint of torch's GradScaler (ddp, fsdp): its scale and clean steps
            scaler.cur_scale = state["scale"]
            scaler.last_overflow_iter = scaler.cur_iter - state["clean_steps"] - 1

    def _flat_partitions(self) -> list:
        """The flat fp32 partitions ZeRO made of this rank's share of the parameters: the tensors torch's AdamW (the
        base optimizer) steps and keys its states by (ZeRO-3 swaps them in and out of its param_groups per step)."""
        if self.zero3:
            return self.optimizer.fp32_partitioned_groups_flat
        return self.optimizer.single_partition_of_fp32_groups

    def save(self, step: int, history: list) -> None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        # each call gathers one whole tensor from the partitions (every rank takes part; the keys come in one order).
        # No state before the first step that was taken (fp16: every step so far overflowed and was skipped)
        flat = self.optimizer.optimizer.state.get(self._flat_partitions()[0], {})
        keys = [key for key, value in flat.items() if torch.is_tensor(value) and value.dim() > 0]  # exp_avg, ...
        parameters, state = {}, {}
        for index, (name, parameter) in enumerate(self.parameters.items()):
            parameters[name] = safe_get_full_fp32_param(parameter).cpu()
            if flat:
                state[index] = {"step": flat["step"].clone(),  # one Adam step count per partition, the same in all
                                **{key: safe_get_full_optimizer_state(parameter, key).cpu() for key in keys}}
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(parameters)))}
                  for group in self.optimizer.optimizer.param_groups[:1]]
        if self.processes.is_main:
            save_checkpoint(self.path, step, history, parameters, {"state": state, "param_groups": groups},
                            self._scaler_state())
        self.processes.barrier()

    def load(self):
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        loaded = load_training_state(self.path, list(self.parameters))
        if loaded is None:
            return None
        parameters, optimizer_state, step, history, scaler = loaded
        saved = optimizer_state["state"].get(0, {})  # none when no step was taken yet (all skipped under fp16)
        keys = [key for key, value in saved.items() if key != "step" and torch.is_tensor(value)]
        # torch's Adam creates its states at the first step: create them now (what its first step would), so that
        # ZeRO's per-parameter views into them exist and the saved values can be scattered into the partitions
        if saved:
            for flat in self._flat_partitions():
                self.optimizer.optimizer.state[flat] = {"step": saved["step"].clone(),
                                                        **{key: torch.zeros_like(flat) for key in keys}}
            if not self.zero3:
                self.optimizer._lazy_init_hp_params_optimizer_state()  # ZeRO-1/2 link those views after a first step
        for index, (name, parameter) in enumerate(self.parameters.items()):
            value = parameters[name].to(parameter.device)
            safe_set_full_fp32_param(parameter, value)  # the fp32 master copy the optimizer updates
            for key in keys:
                safe_set_full_optimizer_state(parameter, optimizer_state["state"][index][key].to(value.device), key)
            if self.zero3:  # the partitioned working copy the forward gathers
                with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0):
                    parameter.data.copy_(value)
            else:
                parameter.data.copy_(value)
        self._restore_scaler(scaler)
        return step, history

    def finish(self) -> None:
        if not self.zero3:
            return  # ZeRO-1/2 trained the model's own tensors in place
        import deepspeed

        full = dict(self.kept)  # frozen tensors that live on outside the model (the same names on every rank)
        for name, parameter in self.model.named_parameters():  # one tensor at a time: the peak stays one model
            if name not in full:
                with deepspeed.zero.GatheredParameters([parameter]):
                    full[name] = parameter.detach().clone()
        self.engine.destroy()  # its hooks and partitions go with the sharded modules
        _restore_whole(self.model, self.skeleton, full)


STRATEGIES = {"ddp": LocalStrategy, "deepspeed": DeepSpeedStrategy, "fsdp": FSDPStrategy}
