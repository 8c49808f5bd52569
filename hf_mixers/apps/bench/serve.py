"""``hf-mixers bench serve``: converted folders against their teacher, each served by vLLM, in the same run.

Runs where vLLM is installed (on this CPU: .venv-vllm, ``make vllm-env``; docs/serving.md). For each model, the
teacher's folder first, one vLLM engine; at each context C and concurrency N, N requests of C random prompt tokens
submitted at once, each generating ``--new-tokens`` greedy tokens (no early stop; token ids in and out, no text):
the wall time gives output tokens/s and total (prompt + output) tokens/s, each also as a ratio to the teacher's at
the same point. A point whose requests do not fit vLLM's cache at once is still measured: vLLM queues them, as a
server would. Written to bench_serve.json and bench_serve.png (output tokens/s against concurrency, a line per model
and context).
"""

from __future__ import annotations

import gc
import itertools
import os
import time

from ...common.dtypes import dtype_name, names_of, to_dtype
from . import register_bench
from ..arguments import at_least, positive_list


def bench_serve(out_dir: str, teacher_dir: str, model_dirs, concurrency=(1, 8, 64), contexts=(512, 4096),
                new_tokens: int = 64, dtype: str = "float32", cache_gib: int = 4, enforce_eager: bool = False,
                repeats: int = 1) -> dict:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise SystemExit("bench serve needs vLLM: on this CPU run it in .venv-vllm (make vllm-env, then "
                         ".venv-vllm/bin/hf-mixers bench serve ...); docs/serving.md") from None
    import torch
    from tqdm.auto import tqdm

    from .harness import save_point, write_report

    folders = {"teacher": teacher_dir, **{os.path.basename(os.path.normpath(folder)): folder
                                          for folder in model_dirs}}
    for folder in folders.values():
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise SystemExit(f"bench serve: {folder} is not a model folder (no config.json)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cache_gib)))  # host memory for vLLM's caches on CPU
    generator = torch.Generator().manual_seed(0)
    rows = []
    progress = tqdm(total=len(folders) * len(contexts) * len(concurrency) * repeats, desc="bench serve",
                    unit="point")
    for label, folder in folders.items():
        llm = LLM(model=folder, dtype=dtype_name(to_dtype(dtype)), max_model_len=max(contexts) + new_tokens,
                  max_num_seqs=max(concurrency), enforce_eager=enforce_eager, seed=0, skip_tokenizer_init=True)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": [3] * min(contexts)}], sampling, use_tqdm=False)  # warm-up
        for context, requests in itertools.product(contexts, concurrency):
            prompts = [{"prompt_token_ids": torch.randint(3, vocab, (context,), generator=generator).tolist()}
                       for _ in range(requests)]
            seconds = []
            for _ in range(repeats):
                began = time.perf_counter()
                outputs = llm.generate(prompts, sampling, use_tqdm=False)
                seconds.append(time.perf_counter() - began)
                progress.update()
            produced = sum(len(output.outputs[0].token_ids) for output in outputs)
            best = min(seconds)
            rows.append({"model": label, "context": context, "concurrency": requests, "seconds": best,
                         "seconds_repeats": seconds, "output_tokens": produced,
                         "output_tokens_per_s": produced / best,
                         "total_tokens_per_s": (produced + context * requests) / best})
            save_point(out_dir, "bench_serve", rows[-1], rows)
        del llm
        gc.collect()
    progress.close()
    teacher_rows = {(row["context"], row["concurrency"]): row for row in rows if row["model"] == "teacher"}
    for row in rows:
        base = teacher_rows[(row["context"], row["concurrency"])]
        row["output_vs_teacher"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
        row["total_vs_teacher"] = row["total_tokens_per_s"] / base["total_tokens_per_s"]
    import vllm

    report = {"benchmark": "serve", "device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": dtype,
              "vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "models": folders, "contexts": list(contexts), "concurrency": list(concurrency),
              "new_tokens": new_tokens, "enforce_eager": enforce_eager, "repeats": repeats, "rows": rows}
    return write_report(report, out_dir, "bench_serve", _plot, lambda r: print(table(r)))


def table(report: dict) -> str:
    lines = [f"vLLM {report['vllm']} on {report['device']} ({report['dtype']}), {report['new_tokens']} new tokens a "
             "request", "", "| model | context | requests | output tok/s | x teacher | total tok/s | x teacher |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['context']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
              f"{r['output_vs_teacher']:.2f} | {r['total_tokens_per_s']:.1f} | {r['total_vs_teacher']:.2f} |"
              for r in report["rows"]]
    return "\n".join(lines)


def _plot(report: dict, path: str) -> None:
    from .harness import plot_against_teacher

    plot_against_teacher(report, itertools.product(report["models"], ["context"], report["contexts"]), "concurrency",
                         "output_tokens_per_s", "concurrent requests", "output tokens/s",
                         f"vLLM {report['vllm']}, {report['device']}, {report['dtype']}", path)


def _arguments(parser) -> None:
    parser.add_argument("model_dirs", nargs="+", metavar="MODEL_DIR", help="converted folders to serve")
    parser.add_argument("--teacher", required=True, metavar="DIR", help="the teacher's folder (a plain "
                        "transformers model vLLM serves natively), the baseline")
    parser.add_argument("--concurrency", type=positive_list, default=[1, 8, 64], help="requests submitted at once "
                        "(default 1,8,64)")
    parser.add_argument("--contexts", type=positive_list, default=[512, 4096], help="prompt tokens a request "
                        "(default 512,4096)")
    parser.add_argument("--new-tokens", type=at_least(1), default=64, help="tokens generated a request (default 64)")
    parser.add_argument("--dtype", choices=names_of("fp32", "bf16"), default="float32")
    parser.add_argument("--cache-gib", type=at_least(1), default=4, help="on CPU: GiB of host memory for vLLM's "
                        "caches (VLLM_CPU_KVCACHE_SPACE, default 4)")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs in vLLM")


def _run(args):
    return bench_serve(args.out, args.teacher, args.model_dirs, concurrency=args.concurrency, contexts=args.contexts,
                       new_tokens=args.new_tokens, dtype=args.dtype, cache_gib=args.cache_gib,
                       enforce_eager=args.enforce_eager, repeats=args.repeats)


register_bench("serve", "output tokens/s of converted folders against their teacher, each served by vLLM, at "
               "several concurrencies and contexts", _arguments, _run)
