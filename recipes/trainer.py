"""One training loop for every stage: deterministic data order, atomic checkpoints, exact resume, NaN stop.

    history = run_stage("stage1", loss_fn, parameters, blocks, steps, plan, lr, out_dir, ...)   # plan: run_plan.py

- Step s reads micro-batches from a permutation of the blocks seeded by (seed, epoch): the order depends only on
  the step, so a resumed run sees exactly the batches the interrupted one would have.
- Every ``checkpoint_every`` steps (and at the end) the strategy writes a checkpoint atomically (ddp:
  ``checkpoints/<stage>.safetensors``, tensors as safetensors and the rest as JSON, nothing pickled; written to a
  temporary file and renamed, the one before kept as ``.previous``): the trained parameters, the optimizer
  state, the step and the loss history. Launching the same run again continues after the last checkpoint with the
  same losses.
- A step's loss and metrics stay on the device until a step whose values are needed (logged, checkpointed,
  evaluated, the last): then every step since the last read is read at once (``PendingSteps``), so the other steps
  queue their work without waiting for it. A NaN or inf loss stops the run there, with its step and the last good
  checkpoint named (checkpoints are written after the read). Under fp16 an overflowing gradient is not an error:
  the loss scaler skips that step and halves its scale (``loss_scale`` in the metrics).
- The rate of each step follows ``train.lr_scheduler`` after ``train.warmup_steps`` (recipes/schedule.py), a
  function of the step: a resumed stage continues it exactly. The optimizer is ``train.optimizer``
  (recipes/optimizers.py).
- Progress bar with loss and tokens/s; one JSON line per logged step in ``metrics.jsonl``, and the same scalars
  to the run's experiment trackers (``train.report_to``, recipes/tracking.py: TensorBoard under ``tensorboard/``);
  every ``train.eval_every`` steps the row also holds ``evaluate()``'s held-out measures (``heldout_*``).
- Several processes (torchrun / accelerate launch): rank r takes micro-batches r, r + world, ...; how they share
  the work is the strategy's (recipes/strategies.py: ddp gradient averaging, DeepSpeed ZeRO-1/2/3, FSDP2);
  rank 0 writes.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import time

import torch
from tqdm.auto import tqdm

from ..common.files import removed_unless_started
from .precision import autocast, fp32_masters
from .processes import Processes
from .profiling import StepProfiler
from .run_plan import RunPlan
from .schedule import learning_rate
from .strategies import STRATEGIES, Sharding


class NonFiniteLoss(FloatingPointError):
    pass


def batch_at(blocks: torch.Tensor, index: int, batch_size: int, seed: int) -> torch.Tensor:
    """Micro-batch number ``index`` of an endless stream of seeded epoch permutations of ``blocks`` (its rows only
    are read: ``blocks`` may be a memory-mapped token-block file)."""
    count = blocks.shape[0]
    per_epoch = max(count // batch_size, 1)
    epoch, position = divmod(index, per_epoch)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return blocks[order[torch.arange(position * batch_size, (position + 1) * batch_size) % count]]


def _rewrite_metrics(path: str, stage: str, last_step: int) -> None:
    """Drop a killed run's metric lines after the checkpoint it resumes from (they are recomputed)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    kept = [row for row in rows if row.get("stage") != stage or row["step"] <= last_step]
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in kept)


def peak_memory(device: torch.device) -> dict:
    """This process's peak memory so far, GiB: resident host memory, and on CUDA the device memory torch reserved."""
    import resource

    peaks = {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device.type == "cuda":
        peaks["device"] = torch.cuda.max_memory_reserved(device) / 2**30
    return {name: round(value, 3) for name, value in peaks.items()}


def check_checkpoint_space(path: str, parameters: dict) -> None:
    """Refuse a stage whose checkpoints cannot fit on the disk, before it trains: each holds the trainable tensors
    and their two Adam moments in fp32, and the one before stays as .previous."""
    needed = 2 * 3 * 4 * sum(parameter.numel() for parameter in parameters.values())
    free = shutil.disk_usage(os.path.dirname(path)).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{os.path.dirname(path)}: the checkpoints need about {needed / 2**30:.2f} GiB "
                                    f"(2 x the {len(parameters)} trainable tensors and their Adam states) and "
                                    f"{free / 2**30:.2f} GiB are free")


class PendingSteps:
    """The steps trained since the device was last read: each one's loss and metrics stay device tensors (a step
    issues no host read) until a step must be read: a logged step, a checkpoint, an evaluation, the last step. Then
    every pending step is read at once, in one transfer (with several processes: one all-reduce of their means and
    one gather of which data each rank trained on), and a non-finite loss among them stops the run."""

    def __init__(self, stage: str, processes: Processes, tokens_per_step: int):
        self.stage, self.processes, self.tokens_per_step = stage, processes, tokens_per_step
        self.steps, self.since = [], time.perf_counter()

    def add(self, row: dict, values: dict, first_rows: list, logged: bool) -> None:
        """One step's row (host values), its device scalars (loss and metrics) and first tokens per row."""
        self.steps.append((row, values, first_rows, logged))

    def read(self, last_good: str | None) -> list[tuple[dict, list, bool]]:
        """Every pending step as (row, first tokens per rank, logged), its values read in; tokens_per_s is the
        rate over the steps read together (a step's own time is not known without reading the device each step)."""
        names = [list(values) for _, values, _, _ in self.steps]
        on = self.processes.device
        flat = torch.stack([torch.as_tensor(value).detach().to(on, torch.float32).reshape(())
                            for _, values, _, _ in self.steps for value in values.values()])
        if self.processes.world > 1:
            torch.distributed.all_reduce(flat)
            flat = flat / self.processes.world
        numbers = iter(flat.tolist())
        first_tokens = self.processes.gather([first for _, _, first, _ in self.steps])  # [rank][step]
        rate = self.tokens_per_step * len(self.steps) / (time.perf_counter() - self.since)
        read = []
        for index, ((row, _, _, logged), keys) in enumerate(zip(self.steps, names)):
            row.update({key: next(numbers) for key in keys}, tokens_per_s=rate)
            if not math.isfinite(row["loss"]):
                raise NonFiniteLoss(f"{self.stage}: the loss is {row['loss']} at step {row['step']}; last good "
                                    f"checkpoint: {last_good or 'none (no checkpoint written yet)'}")
            read.append((row, [ranks[index] for ranks in first_tokens], logged))
        self.steps, self.since = [], time.perf_counter()
        return read


def leaves_nothing_unless_started(run):
    """``run(recipe, ...)``, a training run (distill, finetune), with ``removed_unless_started`` around it
    (common/files.py): a run that fails before it logs a step or saves a checkpoint leaves no recipe.json, packed
    data or tracker folder behind, so a relaunch starts clean."""

    @functools.wraps(run)
    def wrapped(recipe, *args, **kwargs):
        with removed_unless_started(recipe.output.dir):
            return run(recipe, *args, **kwargs)

    return wrapped


def run_stage(stage: str, loss_fn, parameters: dict, blocks: torch.Tensor, steps: int, plan: RunPlan, lr: float,
              out_dir: str, checkpoint_every: int, log_every: int = 1, progress: bool = True,
              processes: Processes | None = None, tokens_per_row: int | None = None,
              sharding: Sharding | None = None, evaluate=None, log_offset: int = 0, batch_of=None) -> list[dict]:
    """Train ``parameters`` (name -> tensor with requires_grad) for ``steps`` optimiser steps on ``blocks``.

    ``loss_fn(batch, metrics) -> (loss, {name: scalar})``, the scalars device tensors, read only on the steps
    ``PendingSteps`` reads (``metrics`` is True on those: a metric that costs work may be left out elsewhere).
    Returns the history: one dict per step (step, loss, metrics). With several processes each rank takes its own
    micro-batches, gradients are averaged (``train.strategy: ddp``), reduce-scattered by DeepSpeed ZeRO
    (``deepspeed``) or by FSDP2 (``fsdp``); rank 0 writes metrics.
    ``tokens_per_row`` (default: the blocks' last dimension) is what one row stands for in the tokens/s figure;
    ``batch_of(rows)`` makes the loss's batch of a micro-batch of rows (default: the rows on the device, as int64).
    ``sharding`` says what ``fsdp`` / ZeRO-3 shard (the model, sharded for the stage, is whole again on return).
    ``evaluate() -> {name: value}``: held-out measures of the model as trained so far, taken every
    ``train.eval_every`` steps on every rank (a sharded model's forward needs them all). The experiment trackers
    (``processes.log``) get step ``log_offset + step``: one increasing step across a run's stages.
    """
    processes = processes or Processes()
    os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
    path = os.path.join(out_dir, "checkpoints", f"{stage}.safetensors")
    check_checkpoint_space(path, parameters)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    device = processes.device
    train, dtype = plan.train, plan.dtype
    if dtype != torch.float32:
        fp32_masters(parameters.values())  # the trained tensors and their AdamW states in fp32
    optimizer = STRATEGIES[train.strategy](parameters, plan, lr, processes, path, loss_fn, sharding)
    history, start = [], 0
    restored = optimizer.load()
    if restored is not None:
        start, history = restored
        if processes.is_main:
            _rewrite_metrics(metrics_path, stage, start)
        if start < steps and processes.is_main:
            tqdm.write(f"{stage}: resuming from the checkpoint at step {start} ({optimizer.path})")
    if start >= steps:
        if restored is not None and processes.is_main:  # a relaunch (or --overwrite) of a finished stage
            tqdm.write(f"{stage}: already trained to step {start} ({optimizer.path}): not trained again; delete "
                       "that checkpoint, or choose another output.dir, to train it from the start")
        optimizer.finish()  # a sharded model comes back whole, with the checkpoint's weights
        return history

    last_good = optimizer.path if restored is not None else None
    tokens_per_step = train.batch_size * train.grad_accum * (tokens_per_row or blocks.shape[-1]) * processes.world
    bar = tqdm(total=steps, initial=start, desc=stage, disable=not (progress and processes.is_main), unit="step")
    metrics_file = open(metrics_path, "a", encoding="utf-8") if processes.is_main else None
    profiler = StepProfiler(train.profile_steps, stage, out_dir, device, enabled=processes.is_main)
    pending = PendingSteps(stage, processes, tokens_per_step)
    try:
        profiler.start()
        for step in range(start + 1, steps + 1):
            began = time.perf_counter()
            evaluates = evaluate is not None and train.eval_every and step % train.eval_every == 0
            checkpoints = step % checkpoint_every == 0 or step == steps
            logged = step % log_every == 0 or step == steps
            reads = logged or checkpoints or evaluates  # this step's end reads every pending step's values
            step_lr = learning_rate(train, lr, step, steps)
            optimizer.set_lr(step_lr)
            optimizer.zero_grad()
            total, extra, first_rows = None, {}, None
            for micro in range(train.grad_accum):
                index = ((step - 1) * train.grad_accum + micro) * processes.world + processes.rank
                rows = batch_at(blocks, index, train.batch_size, train.seed)
                first_rows = rows.flatten(1)[:, 0].tolist() if first_rows is None else first_rows  # still on the host
                batch = rows.to(device, torch.long) if batch_of is None else batch_of(rows)
                with autocast(dtype, device):
                    loss, extra = optimizer.loss(batch, metrics=reads)
                if not loss.requires_grad:
                    raise ValueError(f"{stage}: the loss does not depend on any parameter the stage trains, so it "
                                     "has nothing to learn; a local window as long as the sequences "
                                     "(data.sequence_length <= the mixer's window) never lets a token reach the "
                                     "memory: use longer sequences, a shorter window, or disable the stage")
                optimizer.backward(loss)
                share = loss.detach() / train.grad_accum
                total = share if total is None else total + share
            optimizer.step()
            row = {"stage": stage, "step": step, "lr": step_lr, "world_size": processes.world}
            if device.type == "cuda":  # what the memory plan (distill --plan) is checked against, as the run goes
                row["peak_device_gib"] = peak_memory(device)["device"]
            pending.add(row, {"loss": total, **extra}, first_rows, logged)
            profiler.step(time.perf_counter() - began)
            if not reads:
                bar.update()
                continue
            read = pending.read(last_good)  # NonFiniteLoss if a pending step's loss was not finite
            current = read[-1][0]
            scale = optimizer.loss_scale()
            if scale is not None:  # fp16: the scale after this step (it halves when one overflows)
                current["loss_scale"] = scale
            if evaluates:
                current.update({f"heldout_{key}": value for key, value in evaluate().items()})
            for done, first_tokens, written in read:
                history.append(done)
                if metrics_file and written:
                    metrics_file.write(json.dumps({**done, "first_tokens_per_rank": first_tokens}) + "\n")
                    metrics_file.flush()
                    scalars = [key for key in done if key not in ("stage", "step", "world_size", "peak_device_gib")]
                    processes.log({f"{stage}/{key}": done[key] for key in scalars}, step=log_offset + done["step"])
            bar.set_postfix(loss=f"{history[-1]['loss']:.4g}", tok_s=f"{history[-1]['tokens_per_s']:.0f}")
            bar.update()
            if checkpoints:
                optimizer.save(step, history)
                last_good = optimizer.path
    finally:
        profiler.stop()
        bar.close()
        if metrics_file:
            metrics_file.close()
    optimizer.finish()
    return history
