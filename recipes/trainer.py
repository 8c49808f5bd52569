"""One training loop for every stage: deterministic data order, atomic checkpoints, exact resume, NaN stop.

    history = run_stage("stage1", loss_fn, parameters, blocks, steps, train, lr, out_dir, ...)

- Step s reads micro-batches from a permutation of the blocks seeded by (seed, epoch): the order depends only on
  the step, so a resumed run sees exactly the batches the interrupted one would have.
- Every ``checkpoint_every`` steps (and at the end) ``checkpoints/<stage>.pt`` is written to a temporary file and
  renamed: the trained parameters, the optimizer state, the step and the loss history. Launching the same run
  again continues after the last checkpoint with the same losses.
- A NaN or inf loss stops the run with the step and the last good checkpoint named.
- Progress bar with loss and tokens/s; one JSON line per logged step in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time

import torch
from tqdm.auto import tqdm


class NonFiniteLoss(FloatingPointError):
    pass


def batch_at(blocks: torch.Tensor, index: int, batch_size: int, seed: int) -> torch.Tensor:
    """Micro-batch number ``index`` of an endless stream of seeded epoch permutations of ``blocks``."""
    count = blocks.shape[0]
    per_epoch = max(count // batch_size, 1)
    epoch, position = divmod(index, per_epoch)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return blocks[order[torch.arange(position * batch_size, (position + 1) * batch_size) % count]]


def _save_atomically(state: dict, path: str) -> None:
    temporary = f"{path}.partial"
    torch.save(state, temporary)
    os.replace(temporary, path)


def _rewrite_metrics(path: str, stage: str, last_step: int) -> None:
    """Drop a killed run's metric lines after the checkpoint it resumes from (they are recomputed)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    kept = [row for row in rows if row.get("stage") != stage or row["step"] <= last_step]
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in kept)


def run_stage(stage: str, loss_fn, parameters: dict, blocks: torch.Tensor, steps: int, train, lr: float,
              out_dir: str, checkpoint_every: int, log_every: int = 1, progress: bool = True) -> list[dict]:
    """Train ``parameters`` (name -> tensor with requires_grad) for ``steps`` optimiser steps on ``blocks``.

    ``loss_fn(batch) -> (loss, metrics)``. Returns the history: one dict per step (step, loss, metrics).
    """
    os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
    path = os.path.join(out_dir, "checkpoints", f"{stage}.pt")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    optimizer = torch.optim.AdamW(list(parameters.values()), lr=lr, weight_decay=train.weight_decay)
    history, start = [], 0
    if os.path.exists(path):
        saved = torch.load(path, weights_only=False)
        missing = sorted(set(parameters) - set(saved["parameters"]))
        if missing:
            raise ValueError(f"{path}: checkpoint does not match this run (no {missing[:3]}); use another output.dir")
        with torch.no_grad():
            for name, tensor in parameters.items():
                tensor.copy_(saved["parameters"][name])
        optimizer.load_state_dict(saved["optimizer"])
        history, start = saved["history"], saved["step"]
        _rewrite_metrics(metrics_path, stage, start)
        if start < steps:
            tqdm.write(f"{stage}: resuming from the checkpoint at step {start} ({path})")
    if start >= steps:
        return history

    last_good = path if os.path.exists(path) else None
    tokens_per_step = train.batch_size * train.grad_accum * blocks.shape[1]
    bar = tqdm(total=steps, initial=start, desc=stage, disable=not progress, unit="step")
    with open(metrics_path, "a", encoding="utf-8") as metrics_file:
        for step in range(start + 1, steps + 1):
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, step / train.warmup_steps) if train.warmup_steps else lr
            optimizer.zero_grad(set_to_none=True)
            total, extra = 0.0, {}
            for micro in range(train.grad_accum):
                batch = batch_at(blocks, (step - 1) * train.grad_accum + micro, train.batch_size, train.seed)
                loss, extra = loss_fn(batch)
                if not torch.isfinite(loss):
                    raise NonFiniteLoss(f"{stage}: the loss is {loss.item()} at step {step}; last good checkpoint: "
                                        f"{last_good or 'none (no checkpoint written yet)'}")
                (loss / train.grad_accum).backward()
                total += loss.item() / train.grad_accum
            if train.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(list(parameters.values()), train.max_grad_norm)
            optimizer.step()
            seconds = time.perf_counter() - began
            row = {"stage": stage, "step": step, "loss": total, "lr": optimizer.param_groups[0]["lr"],
                   "tokens_per_s": tokens_per_step / seconds, **{k: float(v) for k, v in extra.items()}}
            history.append(row)
            if step % log_every == 0 or step == steps:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            bar.set_postfix(loss=f"{total:.4g}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update()
            if step % checkpoint_every == 0 or step == steps:
                _save_atomically({"step": step, "history": history, "optimizer": optimizer.state_dict(),
                                  "parameters": {n: t.detach().clone() for n, t in parameters.items()}}, path)
                last_good = path
    bar.close()
    return history

