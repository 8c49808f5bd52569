"""Quality of saved models beyond their training text, next to their teacher (SmolLM2-135M-Instruct):

    python docs/scripts/wider_eval.py RECIPE.yaml MODEL_DIR [MODEL_DIR ...]

For each model: the recipe's held-out set, the sets ``distill`` reports as ``wider_evaluations`` (the held-out text
at 4x the training length, the Python docs at 1x and 4x), and passkey retrieval at 256 and 1024 tokens. Prints one
line per figure and writes them all to wider_eval.json in the working folder.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from hf_mixers.common.corpus import split_texts
from hf_mixers.common.measures import compare_to_teacher, passkey_accuracy
from hf_mixers.conversion import load_teacher
from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.data import pack
from hf_mixers.recipes.stages import wider_evaluation_sets


def main(recipe_file: str, folders: list[str]) -> dict:
    recipe = load_recipe(["recipes/base.yaml", "recipes/stage2_lora_kd.yaml", recipe_file])
    teacher = load_teacher(recipe.model.teacher)
    _, heldout, name = split_texts(recipe.data.source)
    length = recipe.data.sequence_length
    sets = {f"{name}, {length} tokens": pack(teacher.tokenizer, heldout, length, recipe.data.heldout_sequences)}
    sets.update(wider_evaluation_sets(recipe, teacher.tokenizer, heldout, name))
    results = {}
    for folder in [None, *folders]:
        model = teacher.model if folder is None else AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        label, row = folder or "teacher", {}
        for set_name, ids in sets.items() if folder else ():
            row[set_name] = metrics = compare_to_teacher(teacher.model, model.eval(), ids)
            ratio = metrics["student_perplexity"] / metrics["teacher_perplexity"]
            print(f"{label} | {set_name} | perplexity {metrics['student_perplexity']:.2f} (teacher "
                  f"{metrics['teacher_perplexity']:.2f}, {ratio:.3f}x) | KL {metrics['kl_teacher_student']:.3f} | "
                  f"top-1 {metrics['top1_agreement']:.3f}", flush=True)
        passkey = passkey_accuracy(model, teacher.tokenizer, [256, 1024], trials=5, progress=False)
        row["passkey"] = {length: result["accuracy"] for length, result in passkey.items()}
        print(f"{label} | passkey {row['passkey']}", flush=True)
        results[label] = row
    with open("wider_eval.json", "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
