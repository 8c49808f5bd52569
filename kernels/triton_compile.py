"""Compile the Triton kernels one call will launch side by side, before it launches the first.

A Triton kernel compiles at its first launch, one after another: RSA's read is a forward and two backward variants,
Sessa's solve a forward and three backward kernels, tens of seconds each for sm_90. Most of each compile is
``ptxas``, a subprocess, so threads overlap them (``scripts/kernel_resources.py --side-by-side`` measures it;
docs/benchmarks.md "Kernels"). Triton's
own ``AsyncCompileMode`` runs the compiles on an executor; ``JITFunction.warmup`` compiles a launch without running
it, from the same arguments (a ``torch.dtype`` in place of a tensor that does not exist yet:
Triton reads only its dtype, and takes it as 16-byte aligned, as every fresh CUDA allocation is).

Compiled kernels land in Triton's in-process cache and on disk (``~/.triton/cache``), so the launches that follow,
and later processes, find them. Done once per layout and process; a Triton without ``AsyncCompileMode`` (before
3.4), or ``HF_MIXERS_COMPILE_SIDE_BY_SIDE=0``, compiles at first launch, one kernel after another.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

# A try block on purpose (see rsa_chunk_triton.py): imported only once a Triton path was chosen.
try:
    from triton.runtime._async_compile import AsyncCompileMode
except ImportError:  # Triton < 3.4: no asynchronous compile mode
    AsyncCompileMode = None
finally:
    pass

logger = logging.getLogger("hf_mixers.kernels")
SLOW_COMPILE_SECONDS = 2.0
_DONE: set = set()  # layouts whose kernels this process compiled (or loaded from Triton's disk cache) already


def compile_side_by_side(what: str, key, make_warmups) -> bool:
    """Compile each ``(kernel, grid, args, constexprs)`` that ``make_warmups()`` lists on its own thread, unless
    ``key`` (the layout: device, constexprs, specialised sizes) was done already: on every call after the first,
    only the key is looked up. Returns whether it compiled anything."""
    if key in _DONE or AsyncCompileMode is None or os.environ.get("HF_MIXERS_COMPILE_SIDE_BY_SIDE") == "0":
        return False
    began = time.perf_counter()
    warmups = make_warmups()
    with ThreadPoolExecutor(max_workers=max(1, min(len(warmups), os.cpu_count() or 1))) as pool:
        with AsyncCompileMode(pool):  # on exit: every compile finished (its error raised here) and cached
            for kernel, grid, args, constexprs in warmups:
                kernel.warmup(*args, grid=grid, **constexprs)
    _DONE.add(key)
    seconds = time.perf_counter() - began
    # a real compile (tens of seconds on a GPU host) is worth a line in a training log: the first step's pause is it;
    # read from Triton's disk cache it takes well under a second
    logger.log(logging.WARNING if seconds > SLOW_COMPILE_SECONDS else logging.INFO,
               "hf_mixers: %s: %d Triton kernels ready in %.1f s (compiled side by side, or read from Triton's cache)",
               what, len(warmups), seconds)
    return True
