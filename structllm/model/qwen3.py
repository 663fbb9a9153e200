"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rotation
(``ModelConfig.qk_norm == "head"``) and no q/k/v bias."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Qwen3Model(LlamaModel):
    """``LlamaModel`` with ``q_norm``/``k_norm`` in every layer (``[D]``, their entries
    permuted like the interleaved q/k rows)."""


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, HFNames)


MODEL = Qwen3Model
