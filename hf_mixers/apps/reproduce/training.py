"""Training small models on a synthetic task: the loop every trained reproduction shares.

A task is a function ``batch(step) -> (tokens, targets)`` with ``targets`` = IGNORE (-100) wherever nothing is
scored. ``tiny_model`` builds a randomly initialised model of any registered mixer from a config; ``train`` fits it
with AdamW and a cosine schedule; ``scored_accuracy`` counts hits at the scored positions, optionally split by a
per-position group (a lag bucket, a context length).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ...tasks.checks import IGNORE


def tiny_model(mixer: str, vocab: int, length: int, width: int = 64, layers: int = 1, heads: int = 2,
               seed: int = 0, **options):
    """A randomly initialised causal LM whose every layer is ``mixer`` (any registered name), built offline.
    ``options`` go to the config verbatim (a mixer's own options carry its prefix, e.g. ``vort_window``)."""
    from ...model.config import config_class
    from ...model.modeling import model_classes

    torch.manual_seed(seed)
    config = config_class(mixer)(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                 max_position_embeddings=length, **options)
    return model_classes(mixer)[1](config)


class BareMixerModel(torch.nn.Module):
    """Embedding -> one mixer layer -> linear readout: the "simplified" one-layer models of the selective-SSM paper
    (App. D.2), with no norm, MLP or residual. ``positions``: None; "channel", the embedding's last coordinate carries
    the raw 1-indexed position t instead of a learned feature (the paper's PE for SSMs, "|V| fewer parameters"); or
    "learned", a learned table of ``length`` position vectors added to the embedding (its Transformer's)."""

    def __init__(self, mixer: str, vocab: int, width: int, heads: int = 1, positions: str | None = None,
                 length: int = 0, seed: int = 0, **options):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        from ...core.registry import get_mixer
        from ...model.config import config_class

        if positions not in (None, "channel", "learned") or (positions == "learned" and length < 1):
            raise ValueError(f"BareMixerModel: positions must be None, 'channel' or 'learned' (with length >= 1), "
                             f"got {positions!r} (length {length})")
        torch.manual_seed(seed)
        config = config_class(mixer)(vocab_size=vocab, hidden_size=width, intermediate_size=width,
                                     num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                                     head_dim=width // heads, **options)
        config._attn_implementation = "sdpa"  # no model around the mixer to pick it
        self.positions = positions
        self.embed = torch.nn.Embedding(vocab, width - (positions == "channel"))
        self.position_table = torch.nn.Embedding(length, width) if positions == "learned" else None
        self.mixer = get_mixer(mixer).mixer_class(config, 0)
        self.mixer.reset_parameters()
        self.rotary = LlamaRotaryEmbedding(config=config)  # used by the mixers that rotate q and k
        self.readout = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length = tokens.shape
        hidden = self.embed(tokens)  # (B, T, d), or (B, T, d - 1) before the position channel
        if self.positions == "channel":
            t = torch.arange(1, length + 1, dtype=hidden.dtype, device=hidden.device)  # (T,)
            t = t.expand(batch, length)[..., None]  # (B, T, 1)
            hidden = torch.cat([hidden, t], -1)
        elif self.positions == "learned":
            hidden = hidden + self.position_table.weight[:length]
        position_embeddings = self.rotary(hidden, torch.arange(length, device=hidden.device)[None])
        return self.readout(self.mixer(hidden, position_embeddings=position_embeddings))  # (B, T, V)


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T) tokens -> (B, T, V) logits, for a causal LM (``.logits``) or a bare module returning logits."""
    output = model(tokens)
    return getattr(output, "logits", output)


def train(model, batch: Callable[[int], tuple], steps: int, lr: float = 3e-3, cosine: bool = True,
          weight_decay: float = 0.0, clip: float | None = 1.0, desc: str = "training", progress: bool = True) -> list:
    """Fit ``model`` on ``batch(step)`` for ``steps`` AdamW steps. ``cosine``: linear warmup over 5% of the steps,
    then a cosine decay to 1% of ``lr`` (else a constant ``lr``); gradients clipped to ``clip`` unless None. Returns
    the loss of every step."""
    from tqdm.auto import tqdm

    warmup = max(1, steps // 20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if not cosine else min(
        1.0, (step + 1) / warmup) * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for step in bar:
        tokens, targets = batch(step)
        logits = logits_of(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def scored_accuracy(model, tokens: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor | None = None,
                    num_groups: int = 1, batch_size: int = 32) -> tuple[list, list]:
    """Accuracy at the scored positions (targets != IGNORE), per group when ``groups`` (B, T) gives each position's
    group id in [0, num_groups). Returns (accuracy per group, scored positions per group)."""
    model.eval()
    groups = torch.zeros_like(targets) if groups is None else groups
    hits, counts = torch.zeros(num_groups), torch.zeros(num_groups)
    for start in range(0, tokens.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        predicted = logits_of(model, tokens[rows]).argmax(-1)
        scored = targets[rows] != IGNORE
        correct = (predicted == targets[rows]) & scored
        hits += torch.bincount(groups[rows][scored], weights=correct[scored].float(), minlength=num_groups)
        counts += torch.bincount(groups[rows][scored], minlength=num_groups).float()
    return (hits / counts.clamp(min=1)).tolist(), counts.long().tolist()


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
