"""One model family for every mixer: MixerModel / MixerForCausalLM, and the per-mixer subclasses derived from the
registry (``SessaModel`` / ``SessaForCausalLM`` for the "sessa" spec, ...).

    input_ids -> embed_tokens -> [block_0 .. block_{L-1}] -> norm -> lm_head
    block: BLOCK_CLASSES[config.block] (blocks.py)
    mixer of layer i: get_mixer(config.layer_types[i]).mixer_class

The backbone is op-for-op Llama (and Qwen2/Qwen3 through config flags), so an all-"full_attention" model gives
the teacher's logits exactly. ``save_pretrained`` also writes the remote code (export.py), so every saved
folder loads with ``trust_remote_code=True`` where hf_mixers is not installed.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..core.mixer import SequenceMixer, forget_token_mask
from ..core.registry import get_mixer, on_register
from ..decode.engine import announce_auto_decode, auto_decode_refusal, decode_compiled, stack_compiles_decode
from ..decode.switch import compiles, has_token_step
from ..kernels.conventions import COMPILE_MODES
from .blocks import BLOCK_CLASSES, LlamaBlock, SessaBlock
from .config import MixerConfig, config_class
from .export import remote_auto_map, write_remote_code

logger = logging.getLogger(__name__)

# the backend masks a mixer may ask for (MixerSpec.attention_mask)
MASK_BUILDERS = {"causal": create_causal_mask, "sliding": create_sliding_window_causal_mask}


class MixerPreTrainedModel(PreTrainedModel):
    config_class = MixerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaBlock", "SessaBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": [LlamaBlock, SessaBlock]}

    def post_init(self):
        # the parameters kept in fp32 when the model loads in bf16/fp16: those the specs of its layers' mixers name
        # (e.g. Sessa's scalar gain bias), per model, not per class (a hybrid takes every kind's)
        self._keep_in_fp32_modules_strict = sorted({name for kind in set(self.config.layer_types)
                                                    for name in get_mixer(kind).keep_in_fp32})
        super().post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SequenceMixer):
            module.reset_parameters()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save weights and config as usual, plus the self-contained remote code named in ``config.auto_map``."""
        self.config.auto_map = remote_auto_map(self.config)
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory, self.config.layer_types)


class MixerModel(MixerPreTrainedModel):
    def __init__(self, config: MixerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        block_class = BLOCK_CLASSES[config.block]
        self.layers = nn.ModuleList(
            [block_class(config, index, get_mixer(kind).mixer_class) for index, kind in enumerate(config.layer_types)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # only attention-based mixers read a mask; building one costs O(context) per decode step
        self.layer_masks = [get_mixer(kind).attention_mask for kind in config.layer_types]  # per layer, or None
        self.mask_kinds = set(self.layer_masks) - {None}
        self.gradient_checkpointing = False
        self.post_init()

    def replace_mixer(self, index: int, kind: str, build) -> None:
        """Make layer ``index`` a layer of type ``kind`` (e.g. a converted layer restored to attention): the config
        names the kind first (a mixer reads its own kind when built), then ``build()`` makes the new mixer, and the
        backend masks follow."""
        self.config.layer_types[index] = kind
        self.layers[index].mixer = build()
        self.layer_masks[index] = get_mixer(kind).attention_mask
        self.mask_kinds = set(self.layer_masks) - {None}

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        length = inputs_embeds.shape[1]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0

        token_mask = None  # (B, past + T) bool, True = real token; mixers keep padding out of their memories
        forget_token_mask()  # the recurrent layers' shared copy of its last column is made anew for this forward
        if attention_mask is not None and attention_mask.ndim == 2:
            if attention_mask.shape != (inputs_embeds.shape[0], past + length):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but expected "
                    f"{(inputs_embeds.shape[0], past + length)}: {past} cached + {length} new tokens")
            token_mask = attention_mask.bool()
        elif length == 1 and past and any(compiles(block.mixer, inputs_embeds, past_key_values)
                                          for block in self.layers):
            # generate drops a mask of all ones (no padding): with one, and so positions per row, a compiled step
            # runs the graph that a padded batch's steps build instead of compiling a second one
            token_mask = torch.ones(inputs_embeds.shape[0], past + 1, dtype=torch.bool, device=inputs_embeds.device)
        if position_ids is None:
            if token_mask is not None:  # count real tokens only, so a left-padded row sees positions 0, 1, ...
                position_ids = (token_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = (torch.arange(length, device=inputs_embeds.device) + past).unsqueeze(0)

        masks = {kind: MASK_BUILDERS[kind](config=self.config, inputs_embeds=inputs_embeds,
                                           attention_mask=attention_mask, past_key_values=past_key_values,
                                           position_ids=position_ids)
                 for kind in self.mask_kinds}
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        capturing = kwargs.get("output_hidden_states", self.config.output_hidden_states)
        stacked = None  # the whole stack's compiled step, where it runs (None: block by block)
        if stack_compiles_decode(self.layers, hidden_states, past_key_values, capturing):
            stacked = decode_compiled(self.layers, hidden_states, position_embeddings, token_mask, past_key_values)
        if stacked is not None:
            hidden_states = stacked
        else:
            for layer, mask_kind in zip(self.layers, self.layer_masks):
                hidden_states = layer(hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=masks.get(mask_kind), token_mask=token_mask,
                                      past_key_values=past_key_values, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)


class MixerForCausalLM(MixerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    base_model_class = MixerModel

    def __init__(self, config: MixerConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        """transformers' own, with its fixed-size caches (``cache_implementation="static"``, ...) refused in words: they
        build K/V layers of a fixed length, which have no kind for this model's other mixers (a bare KeyError)."""
        try:
            return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)
        except KeyError as error:
            if error.args and error.args[0] in self.config.layer_types:
                raise ValueError(
                    f"generate(cache_implementation={generation_config.cache_implementation!r}): transformers' "
                    f"fixed-size caches hold attention K/V only, not this model's {error.args[0]!r} layers. Leave "
                    "cache_implementation unset (each layer keeps its own cache; a recurrent mixer's state is "
                    "constant-size already); for a compiled token step pass compile_config=CompileConfig(...) or set "
                    "model.config.compile_decode = True ('reduce-overhead': replayed as a CUDA graph)") from None
            raise

    # transformers' generation compile path: ``generate(..., compile_config=CompileConfig(...))`` (or the model's
    # ``generation_config.compile_config``) compiles its decode steps. transformers compiles the whole forward, which
    # needs fixed-size K/V caches; here what compiles is each block's token step (``config.compile_decode``), so the
    # two hooks below route transformers' switch to it: the same lean step, in the CompileConfig's mode.
    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Whether this ``generate`` decodes through compiled steps: compiling is not disabled, and a ``compile_config``
        was given (on any device: the compiled step runs on CPU too) and a layer has a compiled token step, or
        ``config.compile_decode`` is "auto" and decode/engine.py ``auto_decode_refusal`` finds none. transformers' own
        criteria (a GPU and a fixed-size cache, or ``_compile_all_devices``) are for its whole-forward compile, which
        never applies to this model's caches."""
        if generation_config.disable_compile:
            return False
        if generation_config.compile_config is not None:
            return any(has_token_step(block.mixer) for block in self.model.layers)
        if self.config.compile_decode != "auto":  # True or a mode: every step compiles anyway; False: none
            return False
        batch, prompt = _prompt_shape(model_kwargs)
        new_tokens = generation_config.max_new_tokens
        if new_tokens is None and generation_config.max_length is not None and prompt is not None:
            new_tokens = generation_config.max_length - prompt
        refusal = auto_decode_refusal(self.model.layers, self.lm_head.weight, new_tokens, batch)
        announce_auto_decode(refusal)
        return refusal is None

    def get_compiled_call(self, compile_config):
        """What ``generate`` calls for each decode step when ``_valid_auto_compile_criteria`` holds: the model with
        ``config.compile_decode`` set to the CompileConfig's mode for the call (restored after it). Only the mode
        applies: the step is always one graph (fullgraph), with the shapes each mixer needs, on Inductor."""
        mode = "default" if compile_config is None or compile_config.mode is None else compile_config.mode
        if mode not in COMPILE_MODES:
            raise ValueError(f"generate(compile_config=...): mode {mode!r} is not a torch.compile mode the compiled "
                             f"token step takes {COMPILE_MODES}")
        unused = {key: value for key, value in (("backend", getattr(compile_config, "backend", "inductor")),
                                                ("options", getattr(compile_config, "options", None)))
                  if value and value != "inductor"}
        if unused:
            logger.warning("generate(compile_config=...): %s not used; the compiled token step takes the mode only "
                           "(Inductor, one graph per mixer class and batch size)", unused)

        def decode_step(*args, **kwargs):
            saved = self.config.compile_decode
            self.config.compile_decode = mode
            try:
                return self(*args, **kwargs)
            finally:
                self.config.compile_decode = saved

        return decode_step

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        # an int keeps the last N positions (0: all), a tensor the positions it names (transformers' convention)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _prompt_shape(model_kwargs) -> tuple[int | None, int | None]:
    """(batch, prompt length) of a ``generate`` from its model kwargs (generate drops a mask of all ones, and keeps
    the positions); (None, None) when neither is there."""
    for name in ("attention_mask", "position_ids"):
        if isinstance(model_kwargs.get(name), torch.Tensor):
            return model_kwargs[name].shape[0], model_kwargs[name].shape[-1]
    return None, None


def model_classes(name: str) -> tuple[type, type]:
    """(``<Title>Model``, ``<Title>ForCausalLM``) of a registered mixer (MixerModel / MixerForCausalLM for the
    teacher's attention)."""
    spec = get_mixer(name)
    if spec.is_teacher_attention:
        return MixerModel, MixerForCausalLM
    module = sys.modules[__name__]
    return getattr(module, f"{spec.title}Model"), getattr(module, f"{spec.title}ForCausalLM")


def _derive_model_classes(spec) -> None:
    if spec.is_teacher_attention:
        return
    config = config_class(spec.name)
    model = type(f"{spec.title}Model", (MixerModel,), {"__module__": __name__, "config_class": config})
    causal_lm = type(f"{spec.title}ForCausalLM", (MixerForCausalLM,), {
        "__module__": __name__, "config_class": config, "base_model_class": model})
    for cls in (model, causal_lm):
        setattr(sys.modules[__name__], cls.__name__, cls)


def _forget_model_classes(spec) -> None:
    for suffix in ("Model", "ForCausalLM"):
        vars(sys.modules[__name__]).pop(f"{spec.title}{suffix}", None)


on_register(_derive_model_classes, _forget_model_classes)
