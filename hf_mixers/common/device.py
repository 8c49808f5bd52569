"""``--device``: the device a command runs on, checked before any work (one line naming the flag, never a traceback)."""

from __future__ import annotations

import torch


def resolve_device(device: str | None, where: str | None = None) -> torch.device:
    """``device`` (default: cuda when available, else cpu) as a torch.device; a name torch does not know, or a CUDA
    device this machine does not have, is a ValueError naming --device (prefixed by ``where``, e.g. "bench rsa")."""
    where = f"{where}: " if where else ""
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ValueError(f"{where}--device {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}--device {device} asked for, but torch sees no CUDA device "
                         f"(torch {torch.__version__}); leave --device out to run on the CPU")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"{where}--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}--device {device}: only cpu and cuda are supported")
    return resolved
