"""``hf-mixers bench precision``: may a mixer's matrix products take tf32 or bf16 operands (fp32 accumulation)?

A Triton kernel's ``tl.dot`` takes its operands as tf32 ("tf32"), split in two tf32 halves ("tf32x3", about fp32) or
bf16; fewer operand bits mean fewer registers (issue 67: the RSA kernels spill in the dots' operands). The Triton
interpreter computes every dot in fp32, so it cannot show the cost; this emulates it on the mixer's PyTorch path:
every matrix product of one training step (forward and backward: aten ``mm``, ``bmm``, ``addmm``, ``baddbmm``,
which matmul, einsum and linear reach) gets its two operands rounded to tf32 (10 mantissa bits, to nearest even)
or bf16, and accumulates in fp32 (``EmulatedOperands``). The output and every gradient are compared with the same
step in fp64, as normwise relative errors, against the bf16 bound: the error of the step computed exactly (fp64)
from its input and weights rounded to bf16, which a bf16 training run costs anyway (autocast hands the mixer bf16
projections). The bound is per quantity, so a gradient that is a sum with much cancellation (a small bias's) has
the larger bound its conditioning gives it. A precision "fits" when every error is within its bound. Products the
PyTorch form writes as elementwise sums are not rounded, so the emulation is a lower estimate for those.

Written to bench_precision.json and bench_precision.png (error against precision, a line per quantity).
"""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import register_bench, shape_flags
from ..arguments import at_least, key_value, option_dict

MATMULS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}  # aten op -> its two operands' places
PRECISIONS = ("fp32", "tf32", "bf16")


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 with its mantissa rounded to tf32's 10 bits, to nearest even (what a tensor core reads)."""
    bits = x.float().contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    finite = torch.isfinite(x.float())
    return torch.where(finite, rounded.view(torch.float32), x.float())


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


class EmulatedOperands(TorchDispatchMode):
    """Inside, every fp32 matrix product's two operands are rounded to ``precision`` ("tf32" or "bf16") first; the
    product accumulates in fp32 as before. ``scope``: function names; when given, only the products issued inside
    one of them are rounded, forward and backward (a backward product is placed by its forward's traceback, which
    ``torch.autograd.detect_anomaly`` keeps: run the forward under it). ``keep``: function names whose products are
    never rounded (what a kernel keeps fp32-accurate inside the scope). Counts the products rounded (``rounded``)."""

    def __init__(self, precision: str, scope=(), keep=()):
        super().__init__()
        self.round = {"tf32": round_tf32, "bf16": round_bf16}[precision]
        self.scope, self.keep = frozenset(scope), frozenset(keep)
        self.rounded = 0

    def _in_scope(self) -> bool:
        if not self.scope and not self.keep:
            return True
        import traceback

        node = torch._C._current_autograd_node()  # a backward op: where its forward op was issued
        if node is not None:
            stack = node.metadata.get("traceback_", [])
            inside = lambda names: any(f" in {name}\n" in line for line in stack for name in names)  # noqa: E731
        else:
            frames = {frame.name for frame in traceback.extract_stack()}
            inside = lambda names: not frames.isdisjoint(names)  # noqa: E731
        return (not self.scope or inside(self.scope)) and not inside(self.keep)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        places = MATMULS.get(func.overloadpacket.__name__)
        if places is not None and all(args[i].dtype == torch.float32 for i in places) and self._in_scope():
            args = list(args)
            for i in places:
                args[i] = self.round(args[i])
            self.rounded += 1
        return func(*args, **(kwargs or {}))


def _step(module, x, embeddings, precision: str, scope=(), keep=()) -> tuple[dict, int]:
    """One training step of ``module`` on ``x`` (a sum of squares' gradient): {output, d input, d parameters}, and
    the products rounded."""
    from contextlib import nullcontext

    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    mode = EmulatedOperands(precision, scope, keep) if precision in ("tf32", "bf16") else nullcontext()
    tracked = torch.autograd.detect_anomaly(check_nan=False) if scope or keep else nullcontext()
    with mode, tracked:
        out = module(x, embeddings)
        out.pow(2).sum().backward()
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    result = {"output": out.detach(), "d input": x.grad, **{f"d {name}": g for name, g in grads.items()}}
    return result, getattr(mode, "rounded", 0)


def relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """Normwise relative error of ``actual`` against ``exact``, in fp64: the measure of every error and bound here."""
    exact = exact.double()
    return float((actual.double() - exact).norm() / exact.norm().clamp(min=torch.finfo(torch.float64).tiny))


def bench_precision(out_dir: str, mixer: str, options: dict, length: int, hidden_size: int, heads: int,
                    kv_heads: int, scope=(), seed: int = 0, keep=()) -> dict:
    """Errors of one training step of a ``mixer`` layer (``apps/bench/harness.build_mixer``, the PyTorch path) at
    ``length`` tokens, per operand precision (of the products inside the functions ``scope`` names, or all, but
    those inside the functions ``keep`` names), against fp64 and the bf16 bound."""
    from tqdm.auto import tqdm

    from .harness import build_mixer, rotary_embeddings, write_report

    options = {**options, "kernel_backend": "torch"}  # the PyTorch copy of the algorithm
    torch.manual_seed(seed)
    module, config = build_mixer(mixer, options, hidden_size, heads, kv_heads, "cpu", torch.float64)
    x = torch.randn(1, length, hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with tqdm(total=2 + len(PRECISIONS), desc="bench precision", unit="step") as progress:
        embeddings = rotary_embeddings(config, x, length)
        exact, _ = _step(module, x, embeddings, "fp64")
        progress.update()
        rounded = copy.deepcopy(module)
        with torch.no_grad():
            for parameter in rounded.parameters():
                parameter.copy_(round_bf16(parameter).double())
        perturbed, _ = _step(rounded, round_bf16(x).double(), embeddings, "fp64")
        bound = {name: relative_error(perturbed[name], value) for name, value in exact.items()}
        progress.update()
        module.float()
        x32 = x.float()
        embeddings = rotary_embeddings(config, x32, length)
        rows = []
        for precision in PRECISIONS:
            result, rounded = _step(module, x32, embeddings, precision, scope, keep)
            errors = {name: relative_error(result[name], exact[name]) for name in exact}
            fits = all(errors[name] <= bound[name] for name in exact)
            rows.append({"precision": precision, "products_rounded": rounded, "fits_bf16_bound": fits,
                         "worst_ratio_to_bound": max(errors[n] / max(bound[n], 1e-300) for n in exact),
                         "errors": errors})
            progress.update()
    report = {"mixer": mixer, "options": options, "length": length, "shape": [hidden_size, heads, kv_heads],
              "scope": sorted(scope) or "every product", "kept": sorted(keep),
              "torch": torch.__version__, "bf16_bound": bound, "rows": rows}
    return write_report(report, out_dir, "bench_precision", _plot, _show)


def _show(report: dict) -> None:
    kept = f"; kept fp32: {report['kept']}" if report.get("kept") else ""
    print(f"bench precision: {report['mixer']} at T = {report['length']} (the PyTorch path, one training step; "
          f"rounded: {report['scope']}{kept})")
    for row in report["rows"]:
        print(f"  {row['precision']:5s} operands: worst error / bf16 bound {row['worst_ratio_to_bound']:.3g} "
              f"({'within' if row['fits_bf16_bound'] else 'over'} the bound; {row['products_rounded']} products "
              "rounded)")


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    names = ["output", "d input"]
    for name in names:
        axis.plot(PRECISIONS, [row["errors"][name] for row in report["rows"]], marker="o", label=name)
        axis.axhline(report["bf16_bound"][name], linestyle="--", linewidth=0.8, label=f"{name}: bf16 bound")
    axis.set_yscale("log")
    axis.set_xlabel("matrix-product operands")
    axis.set_ylabel("relative error against fp64")
    axis.set_title(f"{report['mixer']}, T = {report['length']}")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _arguments(parser) -> None:
    parser.add_argument("--mixer", default="rsa", help="a registered mixer (default rsa)")
    parser.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="a mixer option by its config name (e.g. rsa_window=64), over its conversion options")
    parser.add_argument("--length", type=at_least(2), default=8192, help="tokens of the step (default 8192)")
    parser.add_argument("--scope", action="append", default=[], metavar="FUNCTION",
                        help="round only the products issued inside this function (repeatable; e.g. read_chunks, "
                             "the RSA read; default: every product)")
    parser.add_argument("--keep", action="append", default=[], metavar="FUNCTION",
                        help="never round the products issued inside this function (repeatable; e.g. read_values, "
                             "what the RSA read kernels keep fp32-accurate)")
    shape_flags(parser)


def _run(args):
    from ...core.registry import get_mixer

    spec = get_mixer(args.mixer)
    options = {**spec.conversion_options, **option_dict(args.option)}
    return bench_precision(args.out, args.mixer, options, args.length, args.hidden_size, args.heads, args.kv_heads,
                           args.scope, keep=args.keep)


register_bench("precision", "a mixer's training step with its matrix products' operands rounded to tf32 or bf16 "
               "(fp32 accumulation) against fp64 and the bf16 bound", _arguments, _run)
