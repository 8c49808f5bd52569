"""The policy that picks the path of a mixer's hot loop: the Triton kernel or the PyTorch reference path.

Each op has one entry function that holds every choice of its own (kernels/feedback_solve.py ``feedback_solve``,
kernels/rsa_memory.py ``rsa_memory``, kernels/mamba_ops.py's scans): the single-token case, fp64, options a kernel
does not cover. It asks this module whether a fast kernel may run. (The selective SSM's ``ssm_scan`` still picks
its PyTorch form itself, by length and shape: docs/architecture.md.)

    backend = HF_MIXERS_BACKEND (environment) or config.kernel_backend:  "auto" | "triton" | "torch"
      auto    Triton when it can run on the tensors' device (CUDA + triton; or TRITON_INTERPRET=1, the CPU
              interpreter used by the tests), else the PyTorch path
      triton  the kernel, or an error saying why it cannot run
      torch   the PyTorch path (chunked forms; the reference math itself)

Maintained libraries' CUDA kernels (mamba_ssm's scans; flash-linear-attention's chunk_simple_gla and chunk_gla;
torch's flex_attention; Liger-Kernel's fused losses) are picked here too, by ``library_kernel``: the same backends
("triton" forces the fast kernel), the same one log line.

Each decision is logged once per process and kernel, with the reason ("tensors on cpu", "triton is not
installed", "forced by HF_MIXERS_BACKEND=torch", ...): a missing fast path is said loudly, never silently.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys

import torch

logger = logging.getLogger("hf_mixers.kernels")

BACKEND_ENV = "HF_MIXERS_BACKEND"
BACKENDS = ("auto", "triton", "torch")
_announced: set = set()
_stand_ins: dict = {}  # "module.attribute" -> a CPU stand-in for a CUDA library kernel (``library_stand_ins``)


def triton_unavailable(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None if device.type == "cpu" else f"TRITON_INTERPRET=1 runs kernels on CPU tensors, not {device.type}"
    if device.type != "cuda":
        return f"tensors on {device.type} (the kernels need CUDA; TRITON_INTERPRET=1 runs them on CPU for tests)"
    return None


def requested_backend(config_value: str = "auto") -> tuple[str, str]:
    """(backend, who asked): the environment variable wins over the config field."""
    value = os.environ.get(BACKEND_ENV)
    backend, source = (value, f"{BACKEND_ENV}={value}") if value else (config_value, f"kernel_backend={config_value!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend; choose one of {', '.join(BACKENDS)}")
    return backend, source


def use_triton(kernel: str, device: torch.device, config_value: str = "auto", check=None, slower=None,
               required: bool = True) -> bool:
    """True when ``kernel`` should run its Triton implementation on ``device``.

    ``check()``: why the kernel cannot handle this call's options (None: it can), asked only once triton can run
    (it may import the kernel module); such calls take the PyTorch path under "auto" and fail under "triton".
    ``slower()``: why the PyTorch path was measured faster for this call (None: it was not); "auto" then takes it,
    "triton" runs the kernel anyway. ``required=False``: a kernel that is an option, never a mixer's own (RoPE's):
    under "triton" it too falls back to PyTorch with its reason instead of failing.
    """
    backend, source = requested_backend(config_value)
    if backend == "torch":
        _announce(kernel, f"PyTorch path (forced by {source})")
        return False
    reason = triton_unavailable(device) or (check() if check is not None else None)
    if reason is None and backend == "auto" and slower is not None and (faster := slower()) is not None:
        _announce(kernel, f"PyTorch path ({faster})")
        return False
    if reason is None:
        _announce(kernel, "Triton kernel" + (f" (forced by {source})" if backend == "triton" else ""))
        return True
    if backend == "triton" and required:
        raise RuntimeError(f"{kernel}: the Triton kernel was requested ({source}) but cannot run: {reason}")
    _announce(kernel, f"PyTorch path ({reason})")
    return False


_installed: dict = {}  # package -> importable, found once a process (a path search on every layer's call otherwise)


@torch.compiler.assume_constant_result  # a constant to torch.compile: the memo filling in is no guard to recompile on
def installed(package: str) -> bool:
    """Whether ``package`` can be imported (a library kernel's, or an entry function choosing between two)."""
    if package not in _installed:
        _installed[package] = importlib.util.find_spec(package) is not None
    return _installed[package]


def library_kernel(kernel: str, module: str, attribute: str, device: torch.device, config_value: str = "auto",
                   check=None):
    """The maintained library's ``module.attribute`` when it should run ``kernel`` on ``device`` (CUDA tensors and the
    library importable), else None: the caller's PyTorch path. Logged once per kernel and decision. ``check()``: why
    the library cannot take this call's options (None: it can), as for ``use_triton``. A forced "triton" fails where
    the library cannot run, except on CPU under TRITON_INTERPRET=1 (which interprets Triton kernels, not a
    library's CUDA ones)."""
    backend, source = requested_backend(config_value)
    if backend == "torch":
        _announce(kernel, f"PyTorch path (forced by {source})")
        return None
    package = module.split(".")[0]
    stand_in = _stand_ins.get(f"{module}.{attribute}") if device.type == "cpu" else None
    if device.type != "cuda" and stand_in is None:
        reason = f"tensors on {device.type} (the {package} kernel needs CUDA)"
    elif stand_in is None and not installed(package):
        reason = f"{package} is not installed"
    elif check is not None and (problem := check()) is not None:
        reason = problem
    elif stand_in is not None:
        return stand_in
    else:
        try:
            # a loaded module from sys.modules: dynamo traces that, not an import (a graph break in a compiled block)
            function = getattr(sys.modules.get(module) or importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            reason = f"{module}.{attribute} cannot be imported ({error})"
        else:
            _announce(kernel, f"{package} kernel {module}.{attribute}")
            return function
    # under TRITON_INTERPRET=1 a forced backend runs our Triton kernels on CPU; a library's CUDA kernel has no
    # interpreted form, so there it stays on the PyTorch path
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu"
    if backend == "triton" and not interpreted:
        raise RuntimeError(f"{kernel}: the fast kernel was requested ({source}) but cannot run: {reason}")
    _announce(kernel, f"PyTorch path ({reason})")
    return None


@contextlib.contextmanager
def library_stand_ins(functions: dict):
    """Inside, a library kernel named in ``functions`` ("module.attribute" -> function) is taken on CPU tensors
    wherever its CUDA call would be, as that function: how apps/bench/op_count.py counts a CUDA-only kernel as the
    launches it makes on a GPU."""
    saved = dict(_stand_ins)
    _stand_ins.update(functions)
    try:
        yield
    finally:
        _stand_ins.clear()
        _stand_ins.update(saved)


def _announce(kernel: str, decision: str) -> None:
    """Log each decision once, from an eager call: not while dynamo traces, where a log call would break the graph
    (a path taken only inside torch.compile is not announced)."""
    if not torch.compiler.is_compiling() and (kernel, decision) not in _announced:
        _announced.add((kernel, decision))
        logger.warning("hf_mixers: %s runs on the %s", kernel, decision)
