"""hf-mixers: turn a pretrained Transformer into a model with new sequence mixers (Sessa, RSA, ...).

Importing the package registers every config/model with transformers' Auto classes.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import MixerConfig, RSAConfig, SessaConfig
from .modeling import (MixerForCausalLM, MixerModel, RSAForCausalLM, RSAModel, SessaForCausalLM,
                       SessaModel)

__version__ = "0.1.0"

for _config, _model, _lm in ((MixerConfig, MixerModel, MixerForCausalLM), (SessaConfig, SessaModel, SessaForCausalLM),
                             (RSAConfig, RSAModel, RSAForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = ["MixerConfig", "MixerModel", "MixerForCausalLM", "SessaConfig", "SessaModel", "SessaForCausalLM", "RSAConfig",
           "RSAModel", "RSAForCausalLM"]
