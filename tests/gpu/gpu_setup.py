"""Where and at which sizes the CUDA tier runs (`pytest -m gpu`, run by `make gpu-check`), and its error measure.

On a CUDA machine these tests run at realistic sizes (SmolLM2-135M and Llama-3-8B head layouts, T up to 8K).
Elsewhere they are skipped, except in the dry run of `make gpu-check` (HF_MIXERS_GPU_CHECK=dry, with
TRITON_INTERPRET=1 set before the process starts): the same tests on CPU tensors, Triton interpreted, at tiny sizes,
so that the CUDA tier never rots between the rare sessions with a GPU.

Each test module sets ``pytestmark = ON_DEVICE`` and may take the ``record`` fixture (imported from here): each
``record(**figures)`` adds a row to the JSON file $HF_MIXERS_GPU_CHECK_RECORDS names, rewritten at once, so a crash
later in the run keeps what was measured.
"""

import json
import os

import pytest
import torch

DRY = os.environ.get("HF_MIXERS_GPU_CHECK") == "dry"
if torch.cuda.is_available() and not DRY:
    DEVICE = torch.device("cuda")
elif DRY and os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
    from triton_interpreter import patch_the_language_once_a_launch

    patch_the_language_once_a_launch()  # idempotent: the import has applied it already
else:
    DEVICE = None

# head layouts (heads, kv heads, head width, Sessa feedback heads): SmolLM2-135M with one feedback head per attention
# head (64 wide; test_kernels_cuda.py adds the official conversion's one 576-wide head, and with 64-wide keys),
# Llama-3-8B
SHAPES = {"smollm2-135m": dict(heads=9, kv_heads=3, head_dim=64, feedback_heads=9),
          "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, feedback_heads=32)} if not DRY else \
    {"tiny": dict(heads=4, kv_heads=2, head_dim=8, feedback_heads=2)}
LENGTHS = (1024, 8192) if not DRY else (40,)

ON_DEVICE = pytest.mark.skipif(DEVICE is None, reason="needs CUDA (make gpu-check runs this tier; its dry run: "
                               "HF_MIXERS_GPU_CHECK=dry with TRITON_INTERPRET=1)")
RECORDS = []


def _write_records() -> None:
    path = os.environ.get("HF_MIXERS_GPU_CHECK_RECORDS")
    if path and DEVICE is not None:
        device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"device": device, "torch": torch.__version__, "records": RECORDS}, handle, indent=1)


_write_records()  # at once, empty: a step whose file is then missing never got this far (gpu_check says so)


@pytest.fixture
def record(request):
    """record(**figures): one row of measured figures for this test in the file $HF_MIXERS_GPU_CHECK_RECORDS."""
    def add(**figures):
        RECORDS.append({"test": request.node.nodeid.split("::", 1)[-1], **figures})
        _write_records()
    return add


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64 (inf for a NaN anywhere)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
