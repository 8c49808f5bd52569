"""recipes/schedule.py and recipes/optimizers.py: the rate of every step is transformers' scheduler's, as a function
of the step (so a resumed stage continues it exactly); the optimizers a recipe can name, and the ones it cannot run
here refused in one line."""

import pytest
import torch
from transformers import get_scheduler

from hf_mixers.recipes import load_recipe
from hf_mixers.recipes.config import RecipeError, TrainSection
from hf_mixers.recipes.optimizers import check_optimizer, make_optimizer, state_bytes
from hf_mixers.recipes.schedule import SCHEDULERS, learning_rate


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_step_has_the_rate_transformers_scheduler_gives_it(name):
    """The rate of step s is the one a transformers scheduler holds after s - 1 updates (what its Trainer uses for
    its s-th step), warmup included; "constant" warms up too."""
    steps, warmup, base = 12, 3, 2e-3
    train = TrainSection(lr_scheduler=name, warmup_steps=warmup, min_lr_rate=0.1)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=base)
    scheduler = get_scheduler(SCHEDULERS[name], optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                              scheduler_specific_kwargs={"min_lr_rate": 0.1} if name == "cosine_with_min_lr" else None)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [learning_rate(train, base, step, steps) for step in range(1, steps + 1)] == pytest.approx(expected)
    assert expected[0] == 0.0 and max(expected) == pytest.approx(base)  # warmup from 0 to the base rate
    if name == "cosine_with_min_lr":
        assert min(expected[warmup:]) >= 0.1 * base * 0.999


def test_without_warmup_the_constant_schedule_is_the_rate():
    train = TrainSection()
    assert [learning_rate(train, 1e-3, step, 5) for step in range(1, 6)] == [1e-3] * 5


def test_unknown_schedules_and_optimizers_are_refused_by_name():
    with pytest.raises(RecipeError, match="train.lr_scheduler must be one of constant, linear, cosine"):
        load_recipe([], ["train.lr_scheduler=cosine_annealing", "output.dir=unused"])
    with pytest.raises(RecipeError, match="train.optimizer must be one of adamw, adafactor, adamw_8bit"):
        load_recipe([], ["train.optimizer=sgd", "output.dir=unused"])
    with pytest.raises(RecipeError, match="train.optimizer=adafactor steps under train.strategy=ddp only"):
        load_recipe([], ["train.optimizer=adafactor", "train.strategy=fsdp", "output.dir=unused"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA or bitsandbytes")
def test_adamw_8bit_is_refused_in_one_line_where_it_cannot_run():
    with pytest.raises(ValueError, match="train.optimizer=adamw_8bit (needs bitsandbytes|runs on a CUDA device)"):
        check_optimizer(TrainSection(optimizer="adamw_8bit"))


def test_adafactor_keeps_factored_states_and_trains():
    """Adafactor's states for a matrix are one row and one column (what state_bytes counts for the memory plan),
    against AdamW's two full tensors, and it lowers a loss as AdamW does."""
    torch.manual_seed(0)
    target = torch.randn(64, 32)
    sizes = {}
    for name in ("adamw", "adafactor"):
        weight = torch.nn.Parameter(torch.zeros(64, 32))
        optimizer = make_optimizer([weight], TrainSection(optimizer=name), 1e-2)
        losses = []
        for _ in range(30):
            optimizer.zero_grad()
            loss = (weight - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.8 * losses[0], name
        state = optimizer.state[weight]
        sizes[name] = sum(v.numel() * v.element_size() for v in state.values()
                          if torch.is_tensor(v) and v.dim() > 0)
        assert sizes[name] == state_bytes(name, [(64, 32)]), name
    assert sizes["adafactor"] * 10 < sizes["adamw"]
