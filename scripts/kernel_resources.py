#!/usr/bin/env python3
"""What each Triton kernel asks of a GPU, read without one: its shared memory, registers, spills and compile time.

`triton.compile` for a `GPUTarget` runs on a CPU (Triton ships `ptxas`); a kernel whose shared memory exceeds the
block limit (227 KiB on an H100 / H200, sm_90) compiles but raises OutOfResources at its first launch, after
minutes of compiling. This script runs the kernels' real launchers on small CPU tensors at a model's head layout
(as `hf-mixers bench kernels` builds them), but every launch is compiled for the target instead of run, so each
forward and backward kernel the layout would launch is measured with the exact constexprs and options it gets.

Run it with the Triton version of the GPU machine (docs/benchmarks.md "Kernels": the lent H100 has Triton 3.6,
this machine's venv 3.9, and they allocate shared memory differently), e.g.

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/t36/lib/python3.11/site-packages/hf_mixers_venv.pth   # torch and this tree, after Triton 3.6
    /tmp/t36/bin/python scripts/kernel_resources.py --kernel rsa --shape smollm2-135m

Registers and spill bytes (stack + local memory per thread) come from the cubin (``cuobjdump --dump-resource-usage``,
shipped with Triton); ``programs`` is the launch's grid (at --length tokens, batch 1; an H100 has 132 SMs). Prints
one line per compiled kernel and writes them as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}  # bytes a block may have (cudaDevAttrMaxSharedMemoryPerBlockOptin)


def cubin_usage(cubin: bytes) -> dict:
    """Registers per thread and spill bytes (the stack frame and local memory per thread) of a compiled kernel, read
    from its cubin by the ``cuobjdump`` that Triton ships (``--dump-resource-usage``): what Triton's
    ``n_regs`` / ``n_spills`` say only once a kernel is loaded on a GPU."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(fields["REG"]), "spill_bytes": int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0))}


def compiling_run(arch: int, records: list, seen: set, pending: list | None = None):
    """A replacement for ``JITFunction.run`` that compiles each launch for sm_``arch`` (once per kernel, constexprs,
    options and argument types) instead of running it, and appends what it needs to ``records``. With ``pending``,
    each compile is appended there as a function instead, for the caller to run (side by side, on threads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)

    def run(self, *args, grid, warmup=False, **kwargs):
        # bound as a launch binds them (triton/runtime/jit.py): argument types, constexprs (a None pointer, an
        # optional input left out, becomes a constexpr None) and the specialisation a launch compiles with -- 16-byte
        # aligned pointers and integers divisible by 16, unless ``do_not_specialize`` -- which vectorises loads and
        # stores and so changes the registers a kernel holds
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, _ = binder(*args, **kwargs)
        launch_options = {key: kwargs[key] for key in ("num_warps", "num_stages", "maxnreg") if key in kwargs}
        _, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, launch_options)
        size = grid(bound) if callable(grid) else grid
        programs = math.prod((size,) if isinstance(size, int) else size)  # this launch's (the variant's first)
        key = (self.__name__, str(specialization), tuple(sorted(launch_options.items())))
        if key in seen:
            return None
        seen.add(key)
        if pending is not None:
            pending.append(lambda: compile_one(self, signature, constexprs, attrs, launch_options, programs))
        else:
            compile_one(self, signature, constexprs, attrs, launch_options, programs)
        return None

    def compile_one(self, signature, constexprs, attrs, options, programs):
        began = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options)
            shared = compiled.metadata.shared
            usage = cubin_usage(compiled.asm["cubin"])
            record = {"kernel": self.__name__, "shared_bytes": shared, **usage,
                      "fits": shared <= SHARED_LIMIT.get(arch, SHARED_LIMIT[90])}
        except Exception as error:  # noqa: BLE001 - report and go on: the point is a list
            text = str(error)  # where it failed comes first, why last: both kept
            text = text if len(text) <= 1200 else f"{text[:400]} [...] {text[-800:]}"
            record = {"kernel": self.__name__, "error": f"{type(error).__name__}: {text}"}
        record.update(programs=programs, seconds=round(time.perf_counter() - began, 1), triton=triton.__version__,
                      arch=arch, options=options,
                      constexprs={self.arg_names[path[0]]: (v if isinstance(v, (int, float, str, bool)) else str(v))
                                  for path, v in constexprs.items()})
        records.append(record)
        print(json.dumps(record), flush=True)

    return run


def run_vort_kernels(shape: dict, length: int) -> None:
    """Every launch of VORT's kernels (write weights, Hedgehog maps, normalised read) and the local window's (the
    flex read's entropy, the shared combine), forward and backward, at a head layout of `hf-mixers bench kernels`."""
    import torch

    from hf_mixers.kernels.hedgehog import hedgehog_pair
    from hf_mixers.kernels.local_attention import flex_read_entropy
    from hf_mixers.kernels.retention import normalised_read
    from hf_mixers.kernels.soe import write_weights
    from hf_mixers.kernels.window_combine import combine_reads

    groups, width = shape["kv_heads"], shape["head_dim"]
    per_group = shape["heads"] // groups
    leaf = lambda *size: torch.randn(*size, requires_grad=True)  # noqa: E731
    weights, skip = write_weights(leaf(1, groups, length), torch.ones(1, length), 64, 15, 8192, backend="triton")
    (weights.sum() + skip.sum()).backward()
    q, k = leaf(1, groups, per_group, length, width), leaf(1, groups, length, width)
    sum(phi.sum() for phi in hedgehog_pair(q, leaf(groups, width, width), k, leaf(groups, width, width),
                                           backend="triton")).backward()
    read = leaf(1, length, groups, per_group, width + 1).permute(0, 2, 3, 1, 4)  # as fla hands it over
    sum(part.sum() for part in normalised_read(read, 1e-6, backend="triton")).backward()
    heads = (1, groups, per_group, length)
    valid = torch.ones(1, 64 + length, dtype=torch.bool)
    sum(part.sum() for part in flex_read_entropy(leaf(*heads, 2 * width), leaf(*heads), leaf(*heads, width), valid,
                                                 64, width, 0.125, backend="triton")).backward()
    combine_reads(leaf(*heads, width), leaf(*heads), leaf(*heads, width), leaf(*heads),
                  torch.ones(1, length, dtype=torch.bool), "shared", backend="triton").sum().backward()


def run_gltm_kernels(shape: dict, length: int) -> None:
    """GLTM's kernels, forward and backward, with pow2_ce's support: the gathered softmax (a (sequence, key head)
    row of a query row a program, its query heads in turn) and the sparse solve (a pipeline: a program per (sequence,
    head, 64 features, block of 16 rows))."""
    import torch

    from hf_mixers.kernels.feedback_solve import sparse_solve
    from hf_mixers.kernels.sparse_attention import gathered_softmax
    from hf_mixers.kernels.token_patterns import support_rows

    groups, width = shape["kv_heads"], shape["head_dim"]
    leaf = lambda *size: torch.randn(*size, requires_grad=True)  # noqa: E731
    support = support_rows("pow2_ce", torch.arange(1, length + 1)[None]) - 1  # (1, T, K): shared by the rows
    gathered_softmax(leaf(groups, length, shape["heads"] // groups, width), leaf(groups, length, width),
                     support.expand(groups, -1, -1), 0.125, gain=torch.rand(groups, length, shape["heads"] // groups),
                     backend="triton").sum().backward()
    weights = torch.rand(shape["heads"], *support.shape[1:], requires_grad=True)
    sparse_solve(leaf(shape["heads"], length, width), weights, support.expand(shape["heads"], -1, -1),
                 backend="triton").sum().backward()


def build_parser() -> argparse.ArgumentParser:
    from hf_mixers.apps.arguments import key_value

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("rsa", "sessa", "vort", "gltm", "all"), default="all")
    parser.add_argument("--shape", default="smollm2-135m", help="a head layout of `hf-mixers bench kernels`")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--length", type=int, default=128, help="sequence length of the sample call")
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 / H200)")
    parser.add_argument("--rsa-option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="an RSA mixer option (e.g. rsa_window=64), as `hf-mixers convert --option`")
    parser.add_argument("--feedback", metavar="KEYS,ROW",
                        help="Sessa: one feedback head with keys KEYS and a row ROW features wide (e.g. 576,576 for "
                             "SmolLM2's official conversion), instead of the shape's")
    parser.add_argument("--side-by-side", action="store_true",
                        help="compile the kernels on threads at once, as kernels/triton_compile.py does before a "
                             "call's first launch, and print the wall time (each record's seconds: under contention)")
    parser.add_argument("--out", help="write the records as JSON here")
    return parser


def main() -> int:
    from hf_mixers.apps.arguments import option_dict

    args = build_parser().parse_args()

    import torch

    import hf_mixers.kernels.dispatch as dispatch
    from hf_mixers.apps.bench.kernels import SHAPES, _candidate
    from hf_mixers.kernels import rsa_chunk_triton

    dispatch.triton_unavailable = lambda device: None  # CPU tensors: every launch is compiled, never run
    rsa_chunk_triton._interpreted = lambda: True
    from triton.runtime.jit import JITFunction

    records, seen, pending = [], set(), [] if args.side_by_side else None
    JITFunction.run = compiling_run(args.arch, records, seen, pending)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    rsa_options = option_dict(args.rsa_option)
    if args.feedback:  # one feedback head of ROW features (heads x head dim) with KEYS-wide keys
        keys, row = (int(size) for size in args.feedback.split(","))
        feedback = dict(heads=1, kv_heads=1, head_dim=row, feedback_heads=1, feedback_key_dim=keys)
    for kernel in ("sessa", "rsa", "vort", "gltm") if args.kernel == "all" else (args.kernel,):
        if kernel in ("vort", "gltm"):
            (run_vort_kernels if kernel == "vort" else run_gltm_kernels)(shape, args.length)
            continue
        layout = feedback if kernel == "sessa" and args.feedback else shape
        _, run = _candidate(f"{kernel}_triton", layout, args.length, "cpu", dtype, generator, 64, rsa_options)
        run().float().pow(2).mean().backward()  # the read's forward and backward kernels, side by side
        if kernel == "rsa":
            with torch.no_grad():  # inference (a prefill): the no-grad launches as well
                run()
    if pending:
        from concurrent.futures import ThreadPoolExecutor

        began = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(pending)) as pool:
            list(pool.map(lambda compile_one: compile_one(), pending))
        print(json.dumps({"side_by_side_seconds": round(time.perf_counter() - began, 1), "kernels": len(pending)}))
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return 0 if all(record.get("fits") for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
