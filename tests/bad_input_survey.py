"""Bad input and faults, tried as a user would: every case a real command in a fresh process, judged the same way.

    python tests/bad_input_survey.py [--module hf_mixers] [--out survey.json]

A case is handled well when the command ends (no hang: 300 s), prints exactly one ``hf-mixers ...`` error line
(exit 2, or 3 for a fault of the machine) and no traceback, and leaves no ``.partial`` staging behind. ``--module``
names how the command is started (``hf_mixers`` now, ``hf_mixers.cli`` for versions before the registry), so the
same survey runs on an older checkout for the before/after count in docs/reliability.md. Not a test file: pytest
does not collect it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

CARD = "---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\ntags: [hf-mixers]\n---\n# T\n"


def _tiny_teacher(folder: str) -> None:
    """A 2-layer Llama and a byte-level tokenizer, built with transformers alone (works with any hf-mixers)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["To be, or not to be, that is the question. " * 200], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(wrapped), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=0, eos_token_id=0, pad_token_id=0)).save_pretrained(folder)
    wrapped.save_pretrained(folder)


def _run(module: str, args: list[str], timeout: int = 300, env: dict | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                                env=env)
    except subprocess.TimeoutExpired:
        return {"exit": None, "errors": [], "traceback": False, "hang": True}
    lines = result.stderr.replace("\r", "\n").splitlines()
    errors = [line for line in lines if line.startswith("hf-mixers") and ": error:" in line]  # not warnings
    return {"exit": result.returncode, "errors": errors,
            "traceback": "Traceback (most recent call last)" in result.stderr, "hang": False,
            "tail": result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []}


def survey(module: str, work: str) -> list[dict]:
    teacher, other = os.path.join(work, "teacher"), os.path.join(work, "other")
    _tiny_teacher(teacher)
    _tiny_teacher(other)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    small = ["--sequence-length", "32", "--calibration-sequences", "2", "--heldout-sequences", "1"]
    converted = os.path.join(work, "converted")
    assert _run(module, ["convert", teacher, "--mixer", "rsa", "--out", converted, *small,
                         "--option", "rsa_num_slots=4", "--option", "rsa_num_levels=1"])["exit"] == 0
    with open(os.path.join(converted, "README.md"), "w") as handle:
        handle.write(CARD)
    files = {name: os.path.join(work, name) for name in ("empty.txt", "short.txt", "binary.txt", "a-file")}
    open(files["empty.txt"], "w").write("\n\n  \n")
    open(files["short.txt"], "w").write("To be, or not to be.\n")
    open(files["binary.txt"], "wb").write(bytes(range(256)) * 64)
    open(files["a-file"], "w").write("")
    headless = os.path.join(work, "headless")  # the converted folder with lm_head.weight gone from the weights
    subprocess.run(["cp", "-r", converted, headless], check=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(headless, "model.safetensors"))
    tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(headless, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(os.path.join(work, "empty-folder"))
    unknown_type = os.path.join(work, "unknown-type")  # its model_type edited to one nobody here knows
    subprocess.run(["cp", "-r", converted, unknown_type], check=True)
    with open(os.path.join(unknown_type, "config.json")) as handle:
        config = json.load(handle)
    config["model_type"] = "someone_elses"
    with open(os.path.join(unknown_type, "config.json"), "w") as handle:
        json.dump(config, handle)
    carded = os.path.join(work, "carded")  # its card written for me/a
    subprocess.run(["cp", "-r", converted, carded], check=True)
    _run(module, ["card", carded, "--repo-id", "me/a"])
    no_weights = os.path.join(work, "no-weights")
    subprocess.run(["cp", "-r", converted, no_weights], check=True)
    os.remove(os.path.join(no_weights, "model.safetensors"))

    distill = ["distill", "--set", f"model.teacher={teacher}", "--set", "data.sequence_length=32", "--set",
               "data.max_train_sequences=4", "--set", "data.heldout_sequences=1", "--set", "stage1.steps=1",
               "--set", "stage2.steps=2", "--set", "output.checkpoint_every=1", "--set", "model.mixer_options="
               "{rsa_num_slots: 4, rsa_num_levels: 1}"]
    run = os.path.join(work, "run")
    assert _run(module, [*distill, "--set", f"output.dir={run}"])["exit"] == 0
    subprocess.run(["rm", "-rf", os.path.join(run, "model")], check=True)  # as if killed after its checkpoints
    corrupted = os.path.join(work, "corrupted")
    subprocess.run(["cp", "-r", run, corrupted], check=True)
    for name in os.listdir(os.path.join(corrupted, "checkpoints")):
        if name.startswith("stage2") and ".previous" not in name:
            with open(os.path.join(corrupted, "checkpoints", name), "wb") as handle:
                handle.write(pickle.dumps({"not": "a checkpoint"}))

    cases = {
        "convert --sequence-length 0": ["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o1",
                                        "--sequence-length", "0"],
        "convert --heldout-sequences 0": ["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o2",
                                          "--heldout-sequences", "0"],
        "convert --calibration-sequences -1": ["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o3",
                                               "--calibration-sequences", "-1"],
        "convert, binary calibration .txt": ["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o4", *small,
                                            "--calibration", files["binary.txt"]],
        "convert --out under a file": ["convert", teacher, "--mixer", "rsa", "--out", f"{files['a-file']}/o", *small],
        "distill stage2.steps=-1": [*distill, "--set", "stage2.steps=-1", "--set", f"output.dir={work}/d1"],
        "distill stage2.temperature=0": [*distill, "--set", "stage2.temperature=0", "--set", f"output.dir={work}/d2"],
        "distill, empty data file": [*distill, "--set", f"data.source={files['empty.txt']}",
                                     "--set", f"output.dir={work}/d3"],
        "distill, too-short data file": [*distill, "--set", f"data.source={files['short.txt']}",
                                         "--set", f"output.dir={work}/d4"],
        "distill, missing model.student": [*distill, "--set", f"model.student={work}/no/such/model",
                                           "--set", f"output.dir={work}/d5"],
        "distill resume, changed lr": [*distill, "--set", "train.lr=0.5", "--set", f"output.dir={run}"],
        "distill resume, changed mixer option": [*distill, "--set", "model.mixer_options={rsa_num_slots: 8}",
                                                 "--set", f"output.dir={run}"],
        "distill resume, corrupted checkpoint": [*distill, "--set", "stage2.steps=3", "--set",
                                                 f"output.dir={corrupted}"],
        "finetune finetune.steps=-5": ["finetune", "--set", f"model.student={converted}", "--set",
                                       "finetune.steps=-5", "--set", f"output.dir={work}/f1"],
        "eval, teacher of another vocabulary": ["eval", converted, "--teacher", other, "--heldout-sequences", "1"],
        "eval, folder without weights": ["eval", no_weights, "--teacher", "none"],
        "push --dry-run, lm_head missing from the weights": ["push", "user/tiny", headless, "--dry-run"],
        "push --dry-run, invalid REPO_ID": ["push", "--dry-run", "not a repo!", converted],
        "card, a plain Llama folder": ["card", teacher],
        # the classes of issue 33 (the newer commands)
        "compare, an option twice": ["compare", "--teacher", teacher, "--mixer", "rsa:window=64,window=8",
                                     "--out", f"{work}/c1"],
        "compare, a refused option value": ["compare", "--teacher", teacher, "--mixer", "rsa:window=-1",
                                            "--out", f"{work}/c2"],
        "compare, a recipe option of no compared mixer": ["compare", "--teacher", teacher, "--mixer", "sessa",
                                                          "--set", "model.mixer_options.rsa_window=8",
                                                          "--out", f"{work}/c3"],
        "compare --out under a file": ["compare", "--teacher", teacher, "--mixer", "sessa",
                                       "--out", f"{files['a-file']}/c"],
        "diagnose, an unknown option": ["diagnose", "rsa", "--option", "nosuch=1", "--out", f"{work}/g1"],
        "diagnose --length 10000000": ["diagnose", "rsa", "--length", "10000000", "--out", f"{work}/g2"],
        "diagnose, a folder without config.json": ["diagnose", work + "/empty-folder", "--out", f"{work}/g3"],
        "diagnose, a binary --text": ["diagnose", converted, "--text", files["binary.txt"], "--out", f"{work}/g4"],
        "convert, a window beyond the positions": ["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o5",
                                                   *small, "--option", "window=100000"],
        "convert, GLTM offsets poly:-1,2": ["convert", teacher, "--mixer", "gltm", "--out", f"{work}/o6", *small,
                                            "--option", "pattern=custom", "--option", "offsets=poly:-1,2"],
        "bench sessa, a flag of another target": ["bench", "sessa", "--decode-batch", "4", "--out", f"{work}/b1"],
        "bench --device nosuch": ["bench", "sessa", "--device", "nosuch", "--out", f"{work}/b2"],
        "eval --device nosuch": ["eval", converted, "--device", "nosuch"],
        "eval, a folder of an unknown model_type": ["eval", unknown_type, "--teacher", "none"],
        "card, an invalid --repo-id": ["card", converted, "--repo-id", "bad repo id!!"],
        "push to another repository than the card's": ["push", "--dry-run", "--repo-id", "me/b", carded],
        "distill, a mixer option value refused": [*distill, "--set", "model.mixer_options={rsa_window: abc}",
                                                  "--set", f"output.dir={work}/d6"],
        "demo --out, a non-empty folder": ["demo", "--out", work, "--max-steps", "1"],
    }
    plugin = os.path.join(work, "plugins")
    os.makedirs(plugin)
    open(os.path.join(plugin, "exiting_plugin.py"), "w").write("import sys\nsys.exit(0)\n")
    with_env = {"a plugin calling sys.exit": (["convert", teacher, "--mixer", "rsa", "--out", f"{work}/o7", *small],
                                              {"HF_MIXERS_PLUGINS": "exiting_plugin", "PYTHONPATH": plugin})}
    results = []
    for name, (args, env) in {**{name: (args, None) for name, args in cases.items()}, **with_env}.items():
        outcome = _run(module, args, env=env)
        leftovers = [p for p in os.listdir(work) if ".partial" in p]
        outcome["handled"] = (outcome["exit"] in (2, 3) and len(outcome["errors"]) == 1 and not outcome["traceback"]
                              and not leftovers)
        results.append({"case": name, **outcome})
        print(f"{'ok  ' if outcome['handled'] else 'BAD '} {name}: exit {outcome['exit']}, "
              f"{(outcome['errors'] or outcome.get('tail') or ['(hang)' if outcome['hang'] else '(no stderr)'])[-1][:150]}",
              flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default="hf_mixers", help="how the CLI is started: python -m MODULE")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf-mixers-survey-") as work:
        results = survey(args.module, work)
    handled = sum(result["handled"] for result in results)
    print(f"{handled} of {len(results)} cases handled well")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
