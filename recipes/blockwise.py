"""Block-wise stage 1: one converted layer at a time, from teacher activations cached on disk.

    capture   one pass of the teacher over the training blocks (no grad, ``batch_size`` rows at a time); every
              converted layer's attention input and output go to ``OUT/stage1-cache/layer<i>.npy`` (memory-mapped,
              float32, N x T x D each), the rotary (cos, sin) of positions 0..T-1 once
    train     for each layer: only that mixer's new parameters, only its activations, in the common loop
              (stage "stage1-layer<i>": its own checkpoints and resume), batches drawn from the cache

Attention transfer trains each layer on the teacher's inputs anyway, so the layers are independent: each layer's
loss is scaled by 1/L like its term in the joint mean, so with gradient clipping off this gives the parameters of
the joint stage 1, while holding one layer's graph and optimizer state at a time and never running the teacher
during training.
Disk: 2 x N x T x D x 4 bytes per converted layer.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def capture_activations(teacher_model, layers, blocks, batch_size: int, folder: str) -> dict:
    """Write the cache (skipped when complete); returns {layer: (inputs, outputs)} memmaps and the rotary."""
    os.makedirs(folder, exist_ok=True)
    count, length = blocks.shape
    width = teacher_model.config.hidden_size
    done = os.path.join(folder, "complete")
    mode = "r" if os.path.exists(done) else "w+"
    arrays = {i: tuple(np.lib.format.open_memmap(os.path.join(folder, f"layer{i}_{part}.npy"), mode=mode,
                                                  dtype=np.float32, shape=(count, length, width))
                       for part in ("inputs", "outputs")) for i in layers}
    rope_path = os.path.join(folder, "rope.safetensors")
    if mode == "w+":
        rows = slice(0, 0)
        rope = {}

        def hook(index):
            def record(module, args, kwargs, output):
                arrays[index][0][rows] = kwargs["hidden_states"].float().cpu().numpy()
                arrays[index][1][rows] = output[0].float().cpu().numpy()
                rope.setdefault("cos_sin", tuple(t[:1].float().cpu() for t in kwargs["position_embeddings"]))
            return record

        handles = [teacher_model.model.layers[i].self_attn.register_forward_hook(hook(i), with_kwargs=True)
                   for i in layers]
        try:
            with torch.no_grad():
                for start in range(0, count, batch_size):
                    rows = slice(start, min(start + batch_size, count))
                    teacher_model.model(blocks[rows].to(teacher_model.device, torch.long), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        for inputs, outputs in arrays.values():
            inputs.flush()
            outputs.flush()
        save_file(dict(zip(("cos", "sin"), rope["cos_sin"])), rope_path)
        open(done, "w").close()  # written last: a killed capture is redone, never half-used
    rope = load_file(rope_path)  # tensors only: nothing in the cache folder is unpickled
    return {"layers": arrays, "rope": (rope["cos"], rope["sin"])}


def transfer_loss(mixer, hidden, position_embeddings, target):
    """Stage 1's loss of one layer: ||mixer(h) - attention(h)||^2 / ||attention(h)||^2, plus the mixer's own
    auxiliary loss if it has one (``SequenceMixer.auxiliary_loss``)."""
    output = mixer(hidden, position_embeddings)
    loss = (output.float() - target.float()).pow(2).mean() / target.float().pow(2).mean().clamp_min(1e-12)
    extra = mixer.auxiliary_loss(hidden, position_embeddings)
    return loss if extra is None else loss + extra


def layer_loss(mixer, arrays, rope, device, scale: float = 1.0):
    """``scale`` x relative MSE of one mixer on cached rows; the batch holds row indices into the cache.

    With scale = 1 / (converted layers) the gradients are exactly those of the joint stage 1 (a mean over layers).
    """
    inputs, outputs = arrays

    def loss_fn(batch, metrics: bool = True):
        rows = batch[:, 0].cpu().numpy()
        hidden = torch.from_numpy(inputs[rows]).to(device)
        target = torch.from_numpy(outputs[rows]).to(device)
        cos, sin = (t.to(device).expand(len(rows), -1, -1) for t in rope)
        return scale * transfer_loss(mixer, hidden, (cos, sin), target), {}
    return loss_fn
