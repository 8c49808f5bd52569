"""ConversionReport: what a conversion did and how far the converted model starts from its teacher.

Written next to the weights as ``conversion_report.json`` (every figure, machine-readable) and
``conversion_report.md`` (the same, for people). Perplexities, KL and agreement are measured on held-out text
before any training; layer errors are the relative L2 distance of the mixer's output from the teacher
attention's output on the same held-out inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from ..common.files import write_atomically
from ..common.history import CONVERSION_REPORT


@dataclass
class LayerReport:
    index: int
    teacher_kind: str  # "full_attention" | "sliding_attention"
    kind: str  # the layer's type in the converted model
    error: float | None  # at-init relative L2 error of the mixer vs the teacher attention (None: not converted)
    note: str = ""
    kl_drop: float | None = None  # keep_attention kl:K: how much the student's KL drops with this layer restored


@dataclass
class ConversionReport:
    source: str
    source_kind: str  # "alias" | "folder" | "hub" | "gguf"
    family: str
    mixer: str
    dtype: str
    layers_converted: list[int]
    layers_kept: list[int]
    keep_attention: str | None  # as requested: a list, "auto:K" or None
    layers: list[LayerReport]
    calibration: str
    calibration_tokens: int
    heldout_tokens: int
    teacher_perplexity: float
    student_perplexity: float
    kl_teacher_student: float  # mean KL(teacher || student) per held-out token, nats
    top1_agreement: float  # fraction of held-out positions where both models predict the same next token
    teacher_parameters: int
    student_parameters: int
    parameters_added: int
    verified_tensors: int  # teacher tensors checked equal in the converted model
    seconds: float
    peak_rss_mib: float
    seed: int
    mixer_options: dict = field(default_factory=dict)
    cache_context: int = 2048
    teacher_cache_bytes: int | None = None  # the teacher's K/V after a cache_context-token prefill (batch 1)
    cache_bytes: int | None = None  # the converted model's decode cache, same prefill, same dtype
    teacher_license: str | None = None
    hf_mixers_version: str = ""

    @property
    def perplexity_ratio(self) -> float:
        return self.student_perplexity / self.teacher_perplexity

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity_ratio": self.perplexity_ratio}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        kept = ", ".join(map(str, self.layers_kept)) or "none"
        lines = [
            f"# Conversion report: {self.source} -> {self.mixer}",
            "",
            "| | |", "|---|---|",
            f"| source | `{self.source}` ({self.source_kind}, family {self.family}) |",
            f"| mixer | {self.mixer} {json.dumps(self.mixer_options) if self.mixer_options else ''} |",
            f"| layers converted | {len(self.layers_converted)} of {len(self.layers)} |",
            f"| layers kept as attention | {kept} (requested: {self.keep_attention or 'none'}) |",
            f"| dtype | {self.dtype} |",
            f"| parameters | teacher {self.teacher_parameters:,}, converted {self.student_parameters:,} "
            f"(+{self.parameters_added:,}) |",
            f"| teacher tensors verified equal after the build | {self.verified_tensors} |",
            f"| time | {self.seconds:.1f} s, peak RSS {self.peak_rss_mib:.0f} MiB |",
            "",
            f"## Before any training (held-out: {self.heldout_tokens} tokens of {self.calibration})",
            "",
            "| | teacher | converted |", "|---|---|---|",
            f"| perplexity | {self.teacher_perplexity:.3f} | {self.student_perplexity:.3f} "
            f"({self.perplexity_ratio:.3f}x) |",
            f"| KL(teacher \u2016 converted), nats/token | | {self.kl_teacher_student:.4f} |",
            f"| next-token top-1 agreement | | {self.top1_agreement:.3f} |",
            *([f"| decode cache after {self.cache_context:,} tokens (batch 1) | "
               f"{self.teacher_cache_bytes / 2**20:.2f} MiB | {self.cache_bytes / 2**20:.2f} MiB "
               f"({self.cache_bytes / self.teacher_cache_bytes:.2f}x) |"] if self.cache_bytes is not None else []),
            "",
            "## Layers",
            "",
            "Error: relative L2 distance of the layer's output from the teacher attention's output on held-out "
            f"inputs ({self.calibration_tokens} calibration tokens fit the mixer).",
            "",
            "| layer | teacher | converted to | at-init error | note |", "|---|---|---|---|---|",
        ]
        ranked = any(layer.kl_drop is not None for layer in self.layers)
        if ranked:  # kl:K: one more column, and what it means
            lines[-3] += (" KL drop: how much KL(teacher \u2016 converted) on calibration text falls when that one "
                          "layer alone is restored to attention (kl:K keeps the K largest).")
            lines[-2:] = ["| layer | teacher | converted to | at-init error | KL drop | note |",
                          "|---|---|---|---|---|---|"]
        for layer in self.layers:
            error = "" if layer.error is None else f"{layer.error:.4g}"
            cells = [str(layer.index), layer.teacher_kind, layer.kind, error]
            if ranked:
                cells.append("" if layer.kl_drop is None else f"{layer.kl_drop:.4f}")
            lines.append("| " + " | ".join([*cells, layer.note]) + " |")
        return "\n".join(lines) + "\n"

    def save(self, folder: str) -> None:
        write_atomically(os.path.join(folder, f"{CONVERSION_REPORT}.json"), self.to_json() + "\n")
        write_atomically(os.path.join(folder, f"{CONVERSION_REPORT}.md"), self.to_markdown())

    @classmethod
    def load(cls, folder: str) -> "ConversionReport":
        with open(os.path.join(folder, f"{CONVERSION_REPORT}.json"), encoding="utf-8") as handle:
            data = json.load(handle)
        data.pop("perplexity_ratio", None)
        data["layers"] = [LayerReport(**layer) for layer in data["layers"]]
        return cls(**data)
