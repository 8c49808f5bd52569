"""Who this process is in a data-parallel run, and what the ranks do together: the one object the training loop
(trainer.py) and the sharding strategies (strategies.py) share."""

from __future__ import annotations

import contextlib

import torch


class Processes:
    """Who this process is in a data-parallel run (accelerate/torchrun launch; one process = rank 0 of 1)."""

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator else 0
        self.world = accelerator.num_processes if accelerator else 1
        self.is_main = self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this process computes: accelerate's device, a CPU one as plain ``cpu``. (Under torchrun accelerate
        says ``cpu:0``, and ``tensor.to("cpu:0")`` copies a tensor already on the CPU: a whole model, every move.)"""
        device = self.accelerator.device if self.accelerator else torch.device("cpu")
        return torch.device("cpu") if device.type == "cpu" else device

    def log(self, values: dict, step: int) -> None:
        """Scalars to the run's experiment trackers (recipes/tracking.py); nothing without them, or off rank 0."""
        if self.accelerator is not None and self.accelerator.log_with:
            self.accelerator.log(values, step=step)

    def mean(self, value: float) -> float:
        if self.world == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(total)
        return total.item() / self.world

    def gather(self, value) -> list:
        if self.world == 1:
            return [value]
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.world > 1:
            self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def main_first(self):
        """The main process runs the block first, the others after it: e.g. tokenising a dataset into ``datasets``'
        cache once, which the others then read back instead of tokenising it again."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()
