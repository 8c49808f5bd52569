"""The learning rate of each optimizer step: transformers' schedulers (``get_scheduler``), read as a function of the
step.

    lr = learning_rate(train, base_lr, step, steps)    # step = 1 .. steps

``train.lr_scheduler`` names the shape over the stage's ``steps``, after ``train.warmup_steps`` of linear warmup;
the rate of step s is the one transformers' Trainer uses for its s-th optimizer step (the scheduler's value after
s - 1 updates). Being a function of the step alone, a resumed stage continues the schedule exactly: there is no
scheduler state to save.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# recipe name -> transformers' scheduler; "constant" honours warmup_steps (transformers' own "constant" ignores it)
SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine",
              "cosine_with_min_lr": "cosine_with_min_lr", "polynomial": "polynomial", "inverse_sqrt": "inverse_sqrt"}


def learning_rate(train, base_lr: float, step: int, steps: int) -> float:
    """The rate of optimizer step ``step`` (1-based) of a stage of ``steps`` steps."""
    return base_lr * _multiplier(train.lr_scheduler, train.warmup_steps, steps, train.min_lr_rate, base_lr)(step - 1)


@lru_cache(maxsize=16)
def _multiplier(name: str, warmup_steps: int, steps: int, min_lr_rate: float, base_lr: float):
    """transformers' multiplier of the base rate after n updates (its LambdaLR's lambda), built once per shape
    (polynomial's depends on the base rate, which it reads from the optimizer)."""
    from transformers import get_scheduler

    extra = {"min_lr_rate": min_lr_rate} if name == "cosine_with_min_lr" else None
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)  # get_scheduler wants an optimizer
    scheduler = get_scheduler(SCHEDULERS[name], probe, num_warmup_steps=warmup_steps,
                              num_training_steps=max(steps, 1), scheduler_specific_kwargs=extra)
    return scheduler.lr_lambdas[0]
