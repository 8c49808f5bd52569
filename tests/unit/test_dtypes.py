"""hf_mixers/common/dtypes.py: one dtype vocabulary, with torch's spellings as aliases, wherever a dtype is named
(a recipe's train.precision and output.dtype, convert's and the benchmarks' --dtype)."""

import pytest
import torch

from hf_mixers.common.dtypes import NAMES, dtype_key, dtype_name, names_of, to_dtype
from hf_mixers.recipes.precision import PRECISIONS, output_dtype, training_dtype

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("short, alias, dtype", [("fp32", "float32", torch.float32),
                                                 ("bf16", "bfloat16", torch.bfloat16), ("fp16", "float16", torch.float16)])
def test_a_short_name_and_torchs_spelling_are_one_dtype(short, alias, dtype):
    assert to_dtype(short) is to_dtype(alias) is dtype
    assert dtype_key(alias) == short and dtype_name(dtype) == alias
    assert training_dtype(alias, torch.device("cpu")) is dtype and output_dtype(alias, torch.float32) is dtype
    assert alias in PRECISIONS


def test_a_name_outside_the_vocabulary_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="train.precision must be one of fp32, bf16, fp16, float32, bfloat16, "
                                         "float16, got 'half'"):
        training_dtype("half", torch.device("cpu"))
    with pytest.raises(ValueError, match="bench: dtype must be one of fp32, bf16, float32, bfloat16, got 'fp16'"):
        to_dtype("fp16", "bench: dtype", names_of("fp32", "bf16"))
    assert set(NAMES) == {"fp32", "bf16", "fp16", "float32", "bfloat16", "float16"}
