"""``hf-mixers card DIR``: the model card (DIR/README.md) of a converted model folder, from its own history.

A folder written by convert / distill / finetune carries what a card needs:

    config.json               the mixer and the layers kept as attention
    conversion_report.json    teacher, family, licence, parameters added, quality at init     (convert)
    training_summary.json     recipe, steps and tokens per stage, quality after each stage    (distill)
    finetune_summary.json     the chat fine-tuning stage                                      (finetune)
    eval_report.json          perplexity / KL / agreement, passkey, decode speed vs teacher  (hf-mixers eval)
    loss_curve.png            shown in the card

The card is rendered from ``template.md`` through huggingface_hub's ``ModelCard.from_template``, then parsed back
with ``ModelCard.load`` and its metadata checked (``check_card``), so a card that the Hub would misread is never
written. Missing history is said in the card, never invented.
"""

from __future__ import annotations

import json
import os

import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData

from ..common.files import write_atomically
from ..common.folder import FolderError, check_model_weights
from ..common.history import (CONVERSION_REPORT, EVAL_REPORT, FINETUNE_SUMMARY, LOSS_CURVE, TRAINING_SUMMARY,
                               blank_or)
from ..core.registry import TEACHER_ATTENTION, get_mixer, list_mixers
from ..decode.switch import grows, has_token_step
from ..model.config import MixerConfig, saved_layer_types

TEMPLATE = os.path.join(os.path.dirname(__file__), "template.md")
# Licence identifiers the Hub knows; any other teacher licence is written as license: other + license_name.
HUB_LICENSES = {"apache-2.0", "mit", "bsd-3-clause", "bsd-2-clause", "gpl-3.0", "lgpl-3.0", "agpl-3.0", "cc-by-4.0",
                "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-nc-sa-4.0", "openrail", "openrail++", "bigscience-openrail-m",
                "creativeml-openrail-m", "llama2", "llama3", "llama3.1", "llama3.2", "llama3.3", "gemma", "unknown",
                "other"}
REQUIRED_METADATA = ("license", "library_name", "pipeline_tag", "tags")
# The hub id behind a convert alias (the alias names an embedded copy of that model).
ALIAS_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class CardError(ValueError):
    """The folder cannot get a card (no config.json), or a rendered card's metadata is incomplete."""


def _read_json(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as error:
            raise CardError(f"{path}: not valid JSON ({error})") from None


def hub_id_of(source: str | None) -> str | None:
    """The hub id behind a teacher or data source, when it has one (an alias maps to the model it embeds; a local
    path or a description has none)."""
    from ..common.corpus import HUB_ID

    if source is None:
        return None
    if source in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[source]
    return source if HUB_ID.fullmatch(source) and not os.path.exists(source) else None


def card_metadata(config: dict, conversion: dict | None, training: dict | None, base_model: str | None,
                  license: str | None) -> ModelCardData:
    licence = (license or (conversion or {}).get("teacher_license") or "unknown").strip().lower()
    extra = {} if licence in HUB_LICENSES else {"license_name": licence.replace(" ", "-")}
    mixers = sorted({kind for kind in saved_layer_types(config) if kind not in TEACHER_ATTENTION})
    tags = ["hf-mixers", *mixers, "converted-attention", "text-generation"]
    if training:
        tags.append("distillation")
    if any(kind in TEACHER_ATTENTION for kind in saved_layer_types(config)) and mixers:
        tags.append("hybrid")
    data = (training or {}).get("data")
    datasets = [data] if data and hub_id_of(data) == data else None  # a hub dataset id, not a local file or Shakespeare
    fields = dict(license=licence if licence in HUB_LICENSES else "other", library_name="transformers",
                  pipeline_tag="text-generation", tags=tags, datasets=datasets, **extra)
    if base_model:
        fields.update(base_model=base_model, base_model_relation="finetune")
    return ModelCardData(**fields)


def _training_context(training: dict | None) -> dict | None:
    if not training:
        return None
    recipe = training.get("recipe", {})
    train = recipe.get("train", {})
    lrs = {"stage1-selection": train.get("lr"), "stage1": train.get("lr"),
           "stage2": recipe.get("stage2", {}).get("lr") or train.get("lr")}
    names = {"stage1-selection": "1: attention transfer, before the kl:K layer choice",
             "stage1": "1: attention transfer", "stage2": "2: LoRA knowledge distillation"}
    stages = [{"name": names.get(name, name), "steps": stage["steps"], "tokens": stage["tokens"],
               "lr": lrs.get(name, ""), "first_loss": blank_or(stage.get("first_loss"), ".4g"),
               "final_loss": blank_or(stage.get("final_loss"), ".4g")} for name, stage in training["stages"].items()]
    return {"stages": stages, "names": list(training["stages"]), "tokens": sum(stage["tokens"] for stage in stages),
            "data": training.get("data"), "sequence_length": training.get("sequence_length"),
            "batch_size": train.get("batch_size", "?"), "world_size": training.get("world_size", 1),
            "merged": recipe.get("output", {}).get("merge_lora", True),
            "ce_weight": recipe.get("stage2", {}).get("ce_weight")}


def evaluation_rows(conversion: dict | None, training: dict | None, evaluation: dict | None) -> tuple[str, list]:
    """(where the figures come from, [(measure, this model, teacher)]): the eval report when there is one, else the
    last evaluation of training, else the conversion report's measure at init."""
    if evaluation:
        q = evaluation["quality"]
        rows = [("held-out perplexity", blank_or(q["student_perplexity"], ".3f"),
                 blank_or(q.get("teacher_perplexity"), ".3f"))]
        if "kl_teacher_student" in q:
            rows += [("KL(teacher \u2016 model), nats/token", blank_or(q["kl_teacher_student"], ".4f"), ""),
                     ("next-token top-1 agreement with the teacher", blank_or(q["top1_agreement"], ".3f"), "")]
        trials = evaluation["passkey_trials"]
        rows += [(f"passkey retrieval, {row['prompt_tokens']:.0f}-token context ({trials} trials)",
                  blank_or(row["model_accuracy"], ".0%"), blank_or(row["teacher_accuracy"], ".0%"))
                 for row in evaluation["passkey"]]
        for row in evaluation["decode"]:
            step = evaluation.get("decode_step", "eager")  # reports before 2026-11-28 did not say: eager
            rows.append((f"decode tokens/s after {row['context']} tokens ({evaluation['device']}, batch 1, the "
                         f"model's token step {step})",
                         blank_or(row["model_tokens_per_s"], ".1f"), blank_or(row["teacher_tokens_per_s"], ".1f")))
            rows.append((f"cache MiB after {row['context']} tokens", blank_or(row["model_cache_bytes"] / 2**20, ".2f"),
                         "" if row["teacher_cache_bytes"] is None else f"{row['teacher_cache_bytes'] / 2**20:.2f}"))
        source = (f"From `eval_report.md` (`hf-mixers eval`): {evaluation['heldout_sequences']} held-out sequences of "
                  f"{evaluation['sequence_length']} tokens of {evaluation['data']}, {evaluation['dtype']} on "
                  f"{evaluation['device']}; teacher `{evaluation['teacher']}`.")
        return source, rows
    if training and training.get("evaluations"):
        stage, q = list(training["evaluations"].items())[-1]
        source = (f"Measured by the distillation run after {stage} on {training.get('heldout_sequences', '')} held-out "
                  f"sequences of {training['sequence_length']} tokens of {training['data']}. Run `hf-mixers eval` for "
                  "passkey retrieval and decode speed.")
    elif conversion:
        q = {"teacher_perplexity": conversion["teacher_perplexity"],
             "student_perplexity": conversion["student_perplexity"],
             "kl_teacher_student": conversion["kl_teacher_student"], "top1_agreement": conversion["top1_agreement"]}
        source = (f"Measured at conversion, before any training, on {conversion['heldout_tokens']} held-out tokens of "
                  f"{conversion['calibration']}. Run `hf-mixers eval` for passkey retrieval and decode speed.")
    else:
        return "Not evaluated: run `hf-mixers eval` on this folder, then `hf-mixers card` again.", []
    return source, [("held-out perplexity", blank_or(q["student_perplexity"], ".3f"),
                     blank_or(q["teacher_perplexity"], ".3f")),
                    ("KL(teacher \u2016 model), nats/token", blank_or(q["kl_teacher_student"], ".4f"), ""),
                    ("next-token top-1 agreement with the teacher", blank_or(q["top1_agreement"], ".3f"), "")]


def limitations(mixers: list[str], kept: list[int], training: dict | None, evaluation: dict | None) -> list[str]:
    lines = []
    if training:
        tokens = sum(stage["tokens"] for stage in training["stages"].values())
        lines.append(f"Distilled on only {tokens:,} tokens of {training['data']}: expect it to trail the teacher "
                     "outside that text, and to have picked up its style.")
    else:
        lines.append("No training is recorded in this folder (no training_summary.json): expect the outputs to differ "
                     "from the teacher's by the conversion error.")
    if evaluation and evaluation["quality"].get("teacher_perplexity"):
        q = evaluation["quality"]
        lines.append(f"Held-out perplexity is {q['student_perplexity'] / q['teacher_perplexity']:.2f}x the teacher's.")
        failed = [row for row in evaluation["passkey"] if (row["teacher_accuracy"] or 0) > row["model_accuracy"]]
        if failed:
            lines.append("Retrieves a passkey less reliably than the teacher at "
                         + ", ".join(f"{row['prompt_tokens']:.0f}" for row in failed) + " tokens of context.")
    for spec in list_mixers():
        if spec.name in mixers:
            lines.extend(spec.limitations)
    if len(kept) == 1:
        lines.append(f"Layer {kept[0]} is still full attention, with its KV cache.")
    elif kept:
        lines.append(f"Layers {', '.join(map(str, kept))} are still full attention, with their KV cache.")
    lines.append("The PyTorch reference paths run here; fused GPU kernels are not used yet.")
    lines.append("Inherits the teacher's limitations, biases and licence terms.")
    return lines


def check_repo_id(repo_id: str) -> None:
    """Raise CardError unless ``repo_id`` is a valid model repository id (owner/name, the Hub's own rule)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("it must be owner/name")
    except HFValidationError as error:
        raise CardError(f"repo id {repo_id!r} is not a valid model repository id: {error}") from None


def decode_steps(config: dict, layer_types: list[str], mixers: list[str]) -> tuple[list[str], list[str]]:
    """The titles of the mixers whose token step ``generate`` compiles by default (``compile_decode: "auto"``: a
    constant-size state) and of those compiled on request only (a cache that grows: symbolic shapes), each asked on
    a layer built on the meta device from the saved config."""
    registered = {spec.name: spec for spec in list_mixers()}
    by_default, on_request = [], []
    switched_off = config.get("compile_decode", "auto") is False  # this folder's config turns the default off
    try:
        model_config = MixerConfig.from_dict(config)
    except (TypeError, ValueError):  # not a config this version reads: no claim about its decoding
        return [], []
    for kind in mixers:
        if kind not in registered:
            continue
        with torch.device("meta"):
            mixer = registered[kind].mixer_class(model_config, layer_types.index(kind))
        if has_token_step(mixer):
            asked_only = grows(mixer) or switched_off
            (on_request if asked_only else by_default).append(registered[kind].title)
    return by_default, on_request


def render_card(folder: str, repo_id: str | None = None, base_model: str | None = None,
                license: str | None = None) -> ModelCard:
    """The card of ``folder`` (not written)."""
    from .. import __version__

    if repo_id is not None:
        check_repo_id(repo_id)
    folder = os.path.abspath(folder)
    config = _read_json(folder, "config.json")
    if config is None:
        raise CardError(f"{folder}: no config.json; pass a saved model folder (convert / distill / finetune output)")
    try:  # a card describes the model the folder holds: its weights must be that model's
        check_model_weights(folder)
    except FolderError as error:
        raise CardError(str(error)) from None
    converted = [kind for kind in saved_layer_types(config) if kind not in TEACHER_ATTENTION]
    if config.get("model_type") not in {"hf_mixer", *(spec.name for spec in list_mixers())} or not converted:
        raise CardError(f"{folder}: not a model converted by hf-mixers (model_type {config.get('model_type')!r}, "
                        f"{len(converted)} mixer layers); hf-mixers card writes the cards of converted models")
    conversion = _read_json(folder, f"{CONVERSION_REPORT}.json")
    training = _read_json(folder, TRAINING_SUMMARY)
    finetune = _read_json(folder, FINETUNE_SUMMARY)
    evaluation = _read_json(folder, f"{EVAL_REPORT}.json")
    teacher = (conversion or {}).get("source") or (training or {}).get("teacher")
    base_model = base_model or hub_id_of(teacher)
    layer_types = saved_layer_types(config)
    kept = [i for i, kind in enumerate(layer_types) if kind in TEACHER_ATTENTION]
    mixers = sorted({kind for kind in layer_types if kind not in TEACHER_ATTENTION})
    mixer = mixers[0] if len(mixers) == 1 else "+".join(mixers) or config.get("model_type", "?")
    try:
        title, summary = get_mixer(mixer).title, get_mixer(mixer).summary
    except KeyError:  # a hybrid of several mixers, or one not registered in this process
        title, summary = mixer, "a hf-mixers sequence mixer"
    name = repo_id.split("/")[-1] if repo_id else os.path.basename(folder)
    by_default, on_request = decode_steps(config, layer_types, mixers)
    if conversion:
        parameters = (f"{conversion['student_parameters']:,} ({conversion['parameters_added']:+,} over the teacher's "
                      f"{conversion['teacher_parameters']:,})")
    else:
        parameters = "not recorded (no conversion_report.json)"
    source, rows = evaluation_rows(conversion, training, evaluation)
    reports = [f"`{n}`" for n in (f"{CONVERSION_REPORT}.md", TRAINING_SUMMARY, FINETUNE_SUMMARY, f"{EVAL_REPORT}.md")
               if os.path.isfile(os.path.join(folder, n))]
    tokenizer_config = _read_json(folder, "tokenizer_config.json") or {}
    context = dict(
        model_name=name, repo_id=repo_id or f"<user>/{name}", teacher=teacher or "an unrecorded teacher",
        base_model=base_model, family=(conversion or {}).get("family"), mixer=mixer, mixer_title=title,
        mixer_summary=summary, mixer_options=json.dumps((conversion or {}).get("mixer_options") or {}).strip("{}"),
        num_layers=len(layer_types), converted_count=len(layer_types) - len(kept),
        kept=", ".join(map(str, kept)), parameters=parameters, training=_training_context(training),
        loss_curve=os.path.isfile(os.path.join(folder, LOSS_CURVE)),
        finetune={"steps": finetune["steps"], "before": blank_or(finetune["heldout_assistant_loss_before"], ".4f"),
                  "after": blank_or(finetune["heldout_assistant_loss_after"], ".4f")} if finetune else None,
        evaluation_source=source, evaluation=rows, limitations=limitations(mixers, kept, training, evaluation),
        chat_template=bool(tokenizer_config.get("chat_template"))
        or os.path.isfile(os.path.join(folder, "chat_template.jinja")),
        version=__version__, reports=", ".join(reports) or "none",
        conversion_report=os.path.isfile(os.path.join(folder, f"{CONVERSION_REPORT}.md")),
        remote_code=os.path.isfile(os.path.join(folder, "modeling_hf_mixers.py")),
        compiled_by_default=" and ".join(by_default), compiled_on_request=" and ".join(on_request))
    metadata = card_metadata(config, conversion, training, base_model, license)
    return ModelCard.from_template(metadata, template_path=TEMPLATE, **context)


def check_card(path: str) -> ModelCard:
    """Parse a written card with huggingface_hub and check the metadata the Hub needs; raises CardError."""
    if not os.path.isfile(path):
        raise CardError(f"{path}: no model card (run `hf-mixers card {os.path.dirname(path)}`)")
    try:
        card = ModelCard.load(path)
    except (ValueError, yaml.YAMLError) as error:
        raise CardError(f"{path}: the card's YAML front matter does not parse: {error}") from None
    data = card.data.to_dict()
    if not data:
        raise CardError(f"{path}: the card has no YAML front matter (metadata between '---' lines), so the Hub "
                        "would not know its licence, library or base model")
    missing = [key for key in REQUIRED_METADATA if not data.get(key)]
    if missing:
        raise CardError(f"{path}: the card's front matter lacks {', '.join(missing)}")
    if data["license"] not in HUB_LICENSES:
        raise CardError(f"{path}: license {data['license']!r} is not a Hub licence id; use 'other' with license_name")
    if data["license"] == "other" and not data.get("license_name"):
        raise CardError(f"{path}: license 'other' needs a license_name")
    if "base_model_relation" in data and not data.get("base_model"):
        raise CardError(f"{path}: base_model_relation without base_model")
    return card


def build_card(folder: str, repo_id: str | None = None, base_model: str | None = None,
               license: str | None = None) -> str:
    """Write ``folder``/README.md (replacing any earlier card) and return its path."""
    card = render_card(folder, repo_id=repo_id, base_model=base_model, license=license)
    path = os.path.join(os.path.abspath(folder), "README.md")

    def write(temporary):
        card.save(temporary)
        check_card(temporary)

    return write_atomically(path, write)
