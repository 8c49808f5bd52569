"""A model folder's history: the files each stage writes next to the weights, and how figures and tables are drawn.

Conversion, training, evaluation and the model card all read or write these files; the names live here once so
that none of them imports another to learn a file name.

    conversion_report.json / .md   hf-mixers convert
    training_summary.json          hf-mixers distill (stages, losses, data)
    loss_curve.png                 hf-mixers distill
    finetune_summary.json          hf-mixers finetune
    eval_report.json / .md         hf-mixers eval
"""

from __future__ import annotations

CONVERSION_REPORT = "conversion_report"  # + .json / .md
TRAINING_SUMMARY = "training_summary.json"
LOSS_CURVE = "loss_curve.png"
FINETUNE_SUMMARY = "finetune_summary.json"
EVAL_REPORT = "eval_report"  # + .json / .md
# what a trained folder carries over from the folder it was trained from
HISTORY_FILES = (f"{CONVERSION_REPORT}.json", f"{CONVERSION_REPORT}.md", TRAINING_SUMMARY, LOSS_CURVE)


def save_figure(figure, path: str, title: str | None = None) -> None:
    """Title, tight layout, PNG at 110 dpi, and the figure closed (every plot of the project ends this way)."""
    import matplotlib.pyplot as plt

    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def blank_or(value, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (+ ``suffix``), or an empty table cell for None."""
    return "" if value is None else f"{value:{spec}}{suffix}"


def wider_table(rows: dict) -> list[str]:
    """Markdown lines: for each model (label -> its ``wider_evaluations``, text -> stage -> metrics), perplexity / the
    teacher's and KL at init -> after the last stage, one column per text (the distill summary's wider evaluations)."""
    texts = list(next(iter(rows.values()), {}))
    if not texts:
        return []
    lines = ["Beyond the training text: perplexity / the teacher's (KL), at init -> after distillation:", "",
             "| model | " + " | ".join(texts) + " |", "|---" * (1 + len(texts)) + "|"]
    for label, wider in rows.items():
        cells = []
        for text in texts:
            stages = list(wider.get(text, {}).values())
            ends = (stages[0], stages[-1]) if stages else ()
            cells.append(" -> ".join(f"{m['student_perplexity'] / m['teacher_perplexity']:.2f}x "
                                     f"({m['kl_teacher_student']:.2f})" for m in ends))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines
