"""``train.profile_steps``: where a training step's time goes, from torch.profiler, next to the run's metrics.

    profiler = StepProfiler(train.profile_steps, stage, out_dir, device, enabled=processes.is_main)
    profiler.start()
    try:
        for step in ...:
            ...one optimizer step...
            profiler.step(seconds)
    finally:
        profiler.stop()

The first step of a stage is left out (it compiles Triton kernels and warms allocators), the second warms the
profiler up, the next ``profile_steps`` are recorded. When the stage ends (or stops) the recorded steps are
written as ``OUT/profile_<stage>.txt``: a header per step -- wall time, kernel launches, host synchronisations,
operator calls -- then torch.profiler's table of operators by self device time (CUDA) or self CPU time, and
``OUT/profile_<stage>.json``, the Chrome / Perfetto trace. The figures answer the first question of a slow step on a
GPU: is the device busy (few long kernels) or waiting on the host (thousands of short launches, synchronisations)?
"""

from __future__ import annotations

import os
import sys

import torch

# CUDA runtime / driver calls that launch a kernel, and those that make the host wait for the device
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCHRONISATIONS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# a host read of a device value (.item(), bool(tensor), .tolist()), a synchronisation on CUDA
HOST_READS = ("aten::_local_scalar_dense",)
SKIPPED_STEPS, WARMUP_STEPS = 1, 1


def summary(events, steps: int, seconds: float | None) -> dict:
    """Per-step counts from ``key_averages()`` events: launches, synchronisations, host reads, operator calls."""
    count = {event.key: event.count for event in events}
    per_step = lambda names: sum(count.get(name, 0) for name in names) / steps  # noqa: E731
    return {"steps": steps, "wall_s_per_step": seconds, "kernel_launches_per_step": per_step(LAUNCHES),
            "synchronisations_per_step": per_step(SYNCHRONISATIONS), "host_reads_per_step": per_step(HOST_READS),
            "aten_calls_per_step": sum(n for key, n in count.items() if key.startswith("aten::")) / steps}


class StepProfiler:
    """Records steps 3 .. 2 + ``steps`` of a stage (none when ``steps`` is 0 or not ``enabled``)."""

    def __init__(self, steps: int, stage: str, out_dir: str, device: torch.device, enabled: bool = True):
        self.steps, self.stage, self.out_dir, self.device = steps, stage, out_dir, device
        self.profile, self.seen, self.recorded_seconds = None, 0, []
        if steps and enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            schedule = torch.profiler.schedule(wait=SKIPPED_STEPS, warmup=WARMUP_STEPS, active=steps, repeat=1)
            self.profile = torch.profiler.profile(activities=activities, schedule=schedule,
                                                  on_trace_ready=self._write)

    def start(self) -> None:
        if self.profile is not None:
            self.profile.start()

    def step(self, seconds: float) -> None:
        """One optimizer step ended, after ``seconds`` of wall time."""
        if self.profile is None:
            return
        self.seen += 1
        if 0 < self.seen - SKIPPED_STEPS - WARMUP_STEPS <= self.steps:  # a recorded step
            self.recorded_seconds.append(seconds)
        self.profile.step()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.stop()  # a stage shorter than the schedule: what was recorded is written here
            self.profile = None
            if not self.recorded_seconds:  # say so rather than leave the user looking for a missing table
                print(f"{self.stage}: train.profile_steps recorded nothing: the stage ran {self.seen} step(s) and "
                      f"the first {SKIPPED_STEPS + WARMUP_STEPS} are never recorded (it needs at least "
                      f"{SKIPPED_STEPS + WARMUP_STEPS + 1})", file=sys.stderr)

    def _write(self, profile) -> None:
        if not self.recorded_seconds:  # the stage ended before its third step: nothing was recorded
            return
        steps = len(self.recorded_seconds)
        events = profile.key_averages()
        facts = summary(events, steps, sum(self.recorded_seconds) / steps)
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        header = [f"{self.stage}: torch.profiler over {steps} step(s) after {SKIPPED_STEPS + WARMUP_STEPS} "
                  f"unrecorded ({self.device.type})"]
        header += [f"  {key}: {round(value, 4) if isinstance(value, float) else value}" for key, value in facts.items()]
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"profile_{self.stage}")
        with open(path + ".txt", "w", encoding="utf-8") as handle:
            handle.write("\n".join(header) + "\n\n" + events.table(sort_by=sort, row_limit=40, max_name_column_width=60)
                         + "\n")
        profile.export_chrome_trace(path + ".json")
