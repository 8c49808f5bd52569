"""Training recipes: typed YAML recipes, data packing, the training loop, and the distillation stages.

    from hf_mixers.recipes import load_recipe, distill
    summary = distill(load_recipe(["recipes/smollm2_rsa.yaml"], ["stage2.steps=50"]))

Files: config.py (Recipe dataclasses, stacking, overrides), data.py (text -> packed token blocks, held-out split),
trainer.py (the loop: checkpoints, resume, NaN stop, metrics), processes.py (the ranks of a data-parallel run),
strategies.py (ddp, DeepSpeed ZeRO, FSDP2 and their checkpoints), stages.py (stage 1 and stage 2, export),
sft.py (stage 3: chat fine-tuning).
"""

from .config import Recipe, RecipeError, load_recipe
from .sft import finetune
from .stages import distill

__all__ = ["Recipe", "RecipeError", "load_recipe", "distill", "finetune"]
