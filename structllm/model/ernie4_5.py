"""ERNIE 4.5 (dense, 0.3B): the Llama decoder whose rotation pairs ``x[2i]`` with
``x[2i + 1]`` (GPT-J's layout, ours), so neither the checkpoint's q/k rows nor
llama.cpp's (which keeps them) are permuted. Its ``use_bias`` (biases on every
projection, off in the published models) is refused (``config._ernie4_5``)."""

from __future__ import annotations

from torch import Tensor

from structllm.model.config import ModelConfig
from structllm.model.llama import HFNames, LlamaModel
from structllm.model.llama import hf_to_native as _hf_to_native


class Ernie4_5Model(LlamaModel):
    """``LlamaModel``; only its q/k row order differs (``Ernie4_5Names``)."""


class Ernie4_5Names(HFNames):
    rope_interleaved = True


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return _hf_to_native(state, cfg, Ernie4_5Names)


MODEL = Ernie4_5Model
