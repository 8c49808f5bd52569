"""The ``hf-mixers`` command line: ``hf-mixers demo`` and ``hf-mixers bench sessa|rsa``."""

from __future__ import annotations

import argparse
import os
import sys


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mixers", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="build a small Sessa model, generate, save, reload via remote code")
    demo.add_argument("--out", default="outputs/demo", help="output folder (default: outputs/demo)")
    demo.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")
    demo.add_argument("--max-steps", type=int, default=300, help="training steps (a small number = a smoke run)")

    bench = commands.add_parser("bench", help="benchmarks, written as JSON and PNG")
    bench.add_argument("target", choices=["sessa", "rsa"], help="what to benchmark")
    bench.add_argument("--out", default="outputs/bench", help="output folder (default: outputs/bench)")
    bench.add_argument("--lengths", type=_int_list, default=None,
                       help="training sequence lengths (default sessa: 512,...,4096; rsa: 512,...,8192)")
    bench.add_argument("--contexts", type=_int_list, default=[1024, 4096, 16384], help="rsa: decoding contexts")
    bench.add_argument("--decode-layers", type=int, default=2, help="rsa: layers of the decoding models")
    bench.add_argument("--decode-tokens", type=int, default=16, help="rsa: decode steps timed per context")
    bench.add_argument("--hidden-size", type=int, default=576, help="model width (default: SmolLM2-135M's 576)")
    bench.add_argument("--heads", type=int, default=9, help="attention heads (default 9)")
    bench.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3)")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    bench.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.out, overwrite=args.overwrite, max_steps=args.max_steps)
    elif args.command == "bench" and args.target == "sessa":
        from .bench import bench_sessa

        bench_sessa(args.out, lengths=args.lengths or [512, 1024, 2048, 4096], hidden_size=args.hidden_size,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, batch_size=args.batch_size,
                    repeats=args.repeats, dtype=args.dtype, device=args.device)
    elif args.command == "bench":
        from .bench_rsa import bench_rsa

        bench_rsa(args.out, lengths=args.lengths or [512, 1024, 2048, 4096, 8192], contexts=args.contexts,
                  hidden_size=args.hidden_size, num_heads=args.heads, num_kv_heads=args.kv_heads,
                  decode_layers=args.decode_layers, decode_tokens=args.decode_tokens, repeats=args.repeats,
                  device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
