"""Cached teacher targets for stage 2 (``stage2.teacher_top_k: k``): the teacher runs once over the training blocks,
not in every step.

    targets = cached_top_k(teacher_model, train_ids, k, temperature, teacher_name, batch_rows)
    targets.index[rows], targets.log_probs[rows]   # (b, T, k) int32 / fp32: the blocks ``rows``' top-k targets

For every token the teacher's k most likely next tokens and their log-probabilities at the stage's temperature
(kernels/distill_loss.py ``teacher_top_k``), which ``top_k_distillation_loss`` trains against. They are kept in
$HF_MIXERS_CACHE/teacher-targets/<key>/ (index.int32, log_probs.float32, targets.json), the key a SHA-256 of the
teacher (its name and a checksum of its head and final norm), the training blocks' tokens, k, the temperature and the
teacher's dtype: a run with the same teacher and data (a relaunch, every entry of ``hf-mixers compare``) reads them
back. Written once, by the main process, into a temporary folder renamed when whole; memory-mapped by every process.
8 k bytes a token: 512 B at k = 64, so 1M training tokens take 0.5 GB of disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..common.files import cache_folder
from ..kernels.distill_loss import teacher_top_k

DESCRIPTION = "targets.json"


@dataclass(frozen=True)
class TopKTargets:
    """(N, T, k) memory-mapped tensors: the teacher's top-k next tokens and their log-probabilities per position."""

    index: torch.Tensor
    log_probs: torch.Tensor
    folder: str


def targets_key(teacher_model, train_ids: torch.Tensor, k: int, temperature: float, teacher_name: str) -> str:
    """The cache key: what the targets depend on, hashed (the tokens without a copy of the block file)."""
    digest = hashlib.sha256()
    head, norm = teacher_model.get_output_embeddings().weight, teacher_model.get_decoder().norm.weight
    sample = head.detach()[::max(1, head.shape[0] // 256)]  # a changed teacher changes its head's rows
    checksum = [float(w.detach().double().sum()) for w in (sample, norm)] + [float(sample.double().norm())]
    digest.update(json.dumps({"teacher": teacher_name, "checksum": checksum, "k": k, "temperature": temperature,
                              "dtype": str(head.dtype), "shape": list(train_ids.shape)}).encode())
    digest.update(memoryview(np.ascontiguousarray(train_ids.numpy())).cast("B"))
    return digest.hexdigest()[:32]


def cached_top_k(teacher_model, train_ids: torch.Tensor, k: int, temperature: float, teacher_name: str,
                 batch_rows: int = 8, chunk_rows: int = 512, progress: bool = True,
                 compute: bool = True) -> TopKTargets:
    """The targets of ``train_ids`` (N, T): read from the cache, else computed (``compute``: the main process; the
    others read what it wrote) ``batch_rows`` blocks at a time on the teacher's device, with a progress bar."""
    folder = os.path.join(cache_folder("teacher-targets"), targets_key(teacher_model, train_ids, k, temperature,
                                                                       teacher_name))
    if not os.path.exists(os.path.join(folder, DESCRIPTION)):
        if not compute:
            raise FileNotFoundError(f"{folder}: the teacher's top-{k} targets were not written (the main process "
                                    "computes them)")
        _write(folder, teacher_model, train_ids, k, temperature, batch_rows, chunk_rows, progress)
    return read_targets(folder)


def _write(folder, teacher_model, train_ids, k, temperature, batch_rows, chunk_rows, progress) -> None:
    staging = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    count, length = train_ids.shape
    head = teacher_model.get_output_embeddings().weight
    try:
        with open(os.path.join(staging, "index.int32"), "wb") as index_file, \
                open(os.path.join(staging, "log_probs.float32"), "wb") as log_probs_file, torch.no_grad(), \
                tqdm(total=count * length, desc=f"teacher top-{k} targets", unit="tok", disable=not progress) as bar:
            for start in range(0, count, batch_rows):
                ids = train_ids[start:start + batch_rows].to(teacher_model.device, torch.long)
                hidden = teacher_model.get_decoder()(ids, use_cache=False).last_hidden_state
                index, log_probs = teacher_top_k(hidden.flatten(0, 1), head, k, temperature, chunk_rows)
                index_file.write(index.cpu().numpy().tobytes())
                log_probs_file.write(log_probs.cpu().numpy().tobytes())
                bar.update(ids.numel())
        with open(os.path.join(staging, DESCRIPTION), "w", encoding="utf-8") as handle:
            json.dump({"blocks": count, "length": length, "k": k, "temperature": temperature}, handle)
        try:
            os.replace(staging, folder)
        except OSError:  # another run wrote the same targets first: they are the same
            if not os.path.exists(os.path.join(folder, DESCRIPTION)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_targets(folder: str) -> TopKTargets:
    """The targets written to ``folder``, memory-mapped (pages read as rows are used)."""
    try:
        with open(os.path.join(folder, DESCRIPTION), encoding="utf-8") as handle:
            meta = json.load(handle)
        shape = (meta["blocks"], meta["length"], meta["k"])
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{folder}/{DESCRIPTION}: not a description of teacher targets ({error})") from None
    size = shape[0] * shape[1] * shape[2]
    tensors = []
    for name, dtype in (("index.int32", torch.int32), ("log_probs.float32", torch.float32)):
        path = os.path.join(folder, name)
        if os.path.getsize(path) != size * 4:
            raise ValueError(f"{path}: {os.path.getsize(path)} bytes, not the {size * 4} of {shape} targets")
        tensors.append(torch.from_file(path, shared=False, size=size, dtype=dtype).view(shape))
    return TopKTargets(*tensors, folder=folder)
