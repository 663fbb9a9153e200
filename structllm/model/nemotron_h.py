"""Nemotron-H (``NemotronHForCausalLM``, the dense models: Nemotron-H 4B/8B/47B/56B,
Nemotron Nano 2): a stack of single-operation blocks, each ``x + op(rms_norm(x))``,
whose op is by the config's pattern (``ModelConfig.layer_types``, from the checkpoint's
"M-M-M*-..."):

- "mamba" (M): the Mamba-2 mixer Granite 4 uses (``model.mamba2``: its gated norm
  over ``n_groups`` groups), its state in ``engine.state_cache``;
- "attention" (*): NoPE attention over the paged KV cache, without biases (the shared
  decoder's attention, ``DecoderLayer.attend``, with no MLP after it);
- "mlp" (-): ``down(relu(up(h)) ** 2)``, not gated. It neither attends nor keeps a
  state: no KV blocks and no state slot (``HybridModel.state_shapes``: ``()``).

Hugging Face names: ``model.embeddings``, ``model.layers.{i}.norm`` and
``.mixer.*`` (the original checkpoints say ``backbone.`` for ``model.``),
``model.norm_f``, ``lm_head``. Nemotron 3's mixture-of-experts layers (E) are refused
when the config is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata
from structllm.kernels.packed import linear
from structllm.model import mamba2
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.hybrid import HybridModel, Mixer
from structllm.model.llama import DecoderLayer
from structllm.model.recurrent import RecurrentBatch
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class AttentionBlock(DecoderLayer):
    """Pre-norm (``input_layernorm``), attention, residual: the shared decoder layer's
    first half (``attend``), its MLP's parameters dropped."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, None, index)
        del self.gate_up_proj, self.down_proj, self.post_attention_layernorm
        self.post_attention_layernorm = None
        self.PACKED = ("qkv_proj", "o_proj")

    def forward(
        self,
        x: Tensor,
        rope: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None = None,
    ) -> Tensor:
        return self.attend(x, rope, k_cache, v_cache, meta, impl, tp)


class MambaBlock(nn.Module):
    """Pre-norm, the Mamba-2 mixer over the slot's states, residual."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(dtype, cfg.hidden_size)
        self.mixer = mamba2.Mamba2.from_model_config(cfg, dtype)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        mixer: Mixer = self.mixer  # type: ignore[assignment]
        return x + mixer(h, states, rb)


class MlpBlock(nn.Module):
    """Pre-norm, the relu-squared MLP (``up_proj [F, hidden]``, ``down_proj [hidden,
    F]``), residual. No state: ``states`` is the empty tuple."""

    PACKED = ("up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _param(dtype, h)
        self.up_proj = _param(dtype, f, h)
        self.down_proj = _param(dtype, h, f)

    def forward(self, x: Tensor, states: tuple[Tensor, ...], rb: RecurrentBatch) -> Tensor:
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        up = F.relu(linear(h, self.up_proj, int8_ok=True)).square()  # [T, F]
        return x + linear(up, self.down_proj, int8_ok=True)


class NemotronHModel(HybridModel):
    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        if cfg.attends(index):
            return AttentionBlock(cfg, dtype, index)
        if cfg.recurrent(index) is None:  # "mlp"
            return MlpBlock(cfg, dtype)
        return MambaBlock(cfg, dtype)


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state = {
        ("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): v
        for k, v in state.items()
    }
    out = {"embed_tokens": state.pop("model.embeddings.weight")}
    out["norm"] = state.pop("model.norm_f.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head"] = state.pop("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "input_layernorm"] = state.pop(p + "norm.weight")
        m = p + "mixer."
        if cfg.attends(i):  # q, k, v fused as ours (no rotary: rows as they are)
            qkv = [state.pop(f"{m}{n}_proj.weight") for n in "qkv"]
            out[o + "qkv_proj"] = torch.cat(qkv)
            out[o + "o_proj"] = state.pop(m + "o_proj.weight")
        elif cfg.recurrent(i) is None:
            out[o + "up_proj"] = state.pop(m + "up_proj.weight")
            out[o + "down_proj"] = state.pop(m + "down_proj.weight")
        else:
            out.update(mamba2.from_hf(state, m, o + "mixer."))
    return out


MODEL = NemotronHModel
