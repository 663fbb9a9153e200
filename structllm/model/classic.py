"""The classic decoder layouts (StableLM, Phi-2, GPT-NeoX): the shared decoder's
attention (``DecoderLayer.self_attention``) in a layer whose norms are LayerNorms with
a bias (``ModelConfig.norm_kind``, ``norm_bias``), whose MLP may be ungated
(``act(up(h)) -> down``, ``mlp_gated``) with biases (``mlp_bias``), and whose attention
and MLP may sit side by side on the residual (``parallel_block``):

- "none": ``x += attn(n1(x)); x += mlp(n2(x))``;
- "shared": ``x + attn(n1(x)) + mlp(n1(x))`` (Phi-2, StableLM's ``use_parallel_residual``);
- "separate": ``x + attn(n1(x)) + mlp(n2(x))`` (GPT-NeoX's ``use_parallel_residual``).

Norm biases are parameters of their own beside the weights (``input_layernorm_bias``,
``post_attention_layernorm_bias``, ``norm_bias``); the attention output's bias
(``o_bias``) and the LM head's (``lm_head_bias``) are the shared decoder's.

These layers run on the plain torch path only: the fused CPU ops (``cpu_layer.cpp``)
have no LayerNorm, ungated MLP or parallel block, so ``ClassicModel.use_cpu_ops``
declines them (said on stderr at start) and the quantized formats run their block
matrices through the same ``linear`` without the fused glue.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata
from structllm.kernels.packed import Weight, linear
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.layers import activation, interleave_rope_rows, norm
from structllm.model.llama import DecoderLayer, LlamaModel
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ClassicLayer(DecoderLayer):
    """One layer of a classic layout (see the module docstring). An ungated MLP holds
    ``up_proj [F, hidden]`` and ``down_proj [hidden, F]`` (with ``up_bias [F]``,
    ``down_bias [hidden]``); a gated one the shared ``gate_up_proj``."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None = None, index: int = 0
    ) -> None:
        super().__init__(cfg, dtype, plan, index)
        h = cfg.hidden_size
        ffn = len(plan.ffn) if plan else cfg.intermediate_size
        self.norm_kind, self.parallel = cfg.norm_kind, cfg.parallel_block
        self.gated = cfg.mlp_gated
        self.input_layernorm_bias = _param(dtype, h) if cfg.norm_bias else None
        if self.parallel == "shared":  # one norm feeds both
            del self.post_attention_layernorm
            self.post_attention_layernorm = None
        self.post_attention_layernorm_bias = (
            _param(dtype, h)
            if cfg.norm_bias and self.post_attention_layernorm is not None
            else None
        )
        if not self.gated:
            del self.gate_up_proj
            self.up_proj: Weight = _param(dtype, ffn, h)
        self.up_bias = _param(dtype, (2 if self.gated else 1) * ffn) if cfg.mlp_bias else None
        self.down_bias = _param(dtype, h) if cfg.mlp_bias else None
        up = "gate_up_proj" if self.gated else "up_proj"
        self.PACKED = ("qkv_proj", "o_proj", up, "down_proj")

    def _ln(self, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
        assert w is not None
        return norm(x, w, b, self.eps, self.norm_kind)

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
        """``x: [T, hidden]`` -> ``[T, hidden]``, as ``DecoderLayer.forward``."""
        h = self._ln(x, self.input_layernorm, self.input_layernorm_bias)
        attn_out = self.self_attention(h, rope, k_cache, v_cache, meta, impl, tp)
        if self.parallel == "none":
            x = x + attn_out
            return x + self.mlp(
                self._ln(x, self.post_attention_layernorm, self.post_attention_layernorm_bias), tp
            )
        if self.parallel == "separate":
            h = self._ln(x, self.post_attention_layernorm, self.post_attention_layernorm_bias)
        return x + attn_out + self.mlp(h, tp)

    def mlp(self, h: Tensor, tp: TensorParallelGroup | None) -> Tensor:
        """The MLP of the normed ``h [T, hidden]`` -> ``[T, hidden]`` (all-reduced with
        ``tp``, then its output bias added once)."""
        if self.gated:
            gate, up = linear(h, self.gate_up_proj, self.up_bias, int8_ok=True).chunk(2, dim=-1)
            mid = activation(gate, self.act).mul_(up)
        else:
            mid = activation(linear(h, self.up_proj, self.up_bias, int8_ok=True), self.act)
        out = linear(mid, self.down_proj, int8_ok=True)
        if tp is not None:
            tp.all_reduce(out)
        return out if self.down_bias is None else out.add_(self.down_bias)


class ClassicModel(LlamaModel):
    """``LlamaModel`` of ``ClassicLayer``s, its final norm a LayerNorm where the
    family's are (``norm_bias`` its bias), an LM head bias where it has one."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__(cfg, dtype, plan, layers)
        self.norm_bias = _param(dtype, cfg.hidden_size) if cfg.norm_bias else None
        if cfg.head_bias:
            self.lm_head_bias = _param(dtype, len(plan.vocab) if plan else cfg.vocab_size)
        # GPT-2's learned absolute positions, [max positions, hidden]
        self.position_embeddings = (
            _param(dtype, cfg.max_position_embeddings, cfg.hidden_size)
            if cfg.learned_positions
            else None
        )

    def embed_at(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(input_ids)
        if self.position_embeddings is None:
            return x
        return x + self.position_embeddings[positions]

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return ClassicLayer(cfg, dtype, plan, index)

    def final_norm(self, x: Tensor) -> Tensor:
        return norm(x, self.norm, self.norm_bias, self.cfg.rms_norm_eps, self.cfg.norm_kind)

    def use_cpu_ops(self) -> bool:
        """Declined: the fused ops do not have these layers' norms and blocks (said once
        at start); the plain path runs them, block matrices included."""
        sys.stderr.write(
            f"structllm: {self.cfg.architecture}: the fused CPU layer ops do not run its "
            "layers (LayerNorm, biases, parallel blocks): the plain torch path runs them\n"
        )
        return False


def from_hf_norms(
    state: dict[str, Tensor], out: dict[str, Tensor], cfg: ModelConfig, names: dict[str, str]
) -> None:
    """Each of our norm tensors (``names``: ours -> the checkpoint's module under
    ``model.layers.{i}.``, ``{i}`` filled in) and its bias where the family has them,
    popped from ``state`` into ``out``."""
    for i in range(cfg.num_layers):
        for ours, theirs in names.items():
            p = theirs.format(i=i)
            out[f"layers.{i}.{ours}"] = state.pop(p + ".weight")
            if cfg.norm_bias:
                out[f"layers.{i}.{ours}_bias"] = state.pop(p + ".bias")


class ClassicNames:
    """Where a classic layout's Hugging Face checkpoint keeps each of our tensors: the
    model-level ones by full name (without ``.weight``), the layer ones under
    ``layers`` (``{i}``: the layer); q, k and v may be separate or, fused as ours,
    ``qkv``; ``up``/``down`` the MLP's matrices (a gated one's ``gate`` too, or
    ``gate_up`` fused); None: the family has no such tensor."""

    embed = "model.embed_tokens"
    final_norm = "model.norm"
    lm_head = "lm_head"
    layers = "model.layers.{i}."
    q, k, v = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
    qkv: str | None = None
    o = "self_attn.o_proj"
    gate, up, down = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
    gate_up: str | None = None
    q_norm, k_norm = "self_attn.q_norm", "self_attn.k_norm"  # [H, D] or [H * D]
    input_layernorm = "input_layernorm"
    post_attention_layernorm: str | None = "post_attention_layernorm"
    rope_interleaved = False  # the checkpoint's q/k rows already pair as ours
    norm_plus_one = False  # norms hold w of (1 + w) (Nemotron's LayerNorm1P)


def hf_to_native(
    state: dict[str, Tensor], cfg: ModelConfig, names: type[ClassicNames]
) -> dict[str, Tensor]:
    """A classic layout's Hugging Face tensors -> ours: q/k/v fused (their rotary rows
    interleaved, biases alike), each norm, matrix and bias where the family has it."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def rot(w: Tensor, heads: int) -> Tensor:
        return w if names.rope_interleaved else interleave_rope_rows(w, heads, cfg.rope_dim)

    def pair(ours: str, theirs: str, bias: bool) -> None:
        out[ours] = state.pop(theirs + ".weight")
        if names.norm_plus_one and ours.endswith("norm"):  # (as transformers, in float32)
            out[ours] = out[ours].float() + 1.0
        if bias:
            out[_bias_name(ours)] = state.pop(theirs + ".bias")

    out: dict[str, Tensor] = {"embed_tokens": state.pop(names.embed + ".weight")}
    pair("norm", names.final_norm, cfg.norm_bias)
    if not cfg.tie_word_embeddings:
        pair("lm_head", names.lm_head, cfg.head_bias)
    elif cfg.head_bias:  # a head tied to the embedding, with a bias of its own
        out["lm_head_bias"] = state.pop(names.lm_head + ".bias")
    for i in range(cfg.num_layers):
        p, o = names.layers.format(i=i), f"layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            if names.qkv is not None:
                fused = state.pop(f"{p}{names.qkv}.{kind}")
                q, k, v = fused.split([nh * hd, nkv * hd, nkv * hd])
            else:
                q, k, v = (state.pop(f"{p}{n}.{kind}") for n in (names.q, names.k, names.v))
            ours = "qkv_proj" if kind == "weight" else "qkv_bias"
            out[o + ours] = torch.cat([rot(q, nh), rot(k, nkv), v])
        pair(o + "o_proj", p + names.o, cfg.o_bias)
        if cfg.mlp_gated and names.gate_up is None:  # (no biases: none of ours has them)
            rows = [state.pop(f"{p}{names.gate}.weight"), state.pop(f"{p}{names.up}.weight")]
            out[o + "gate_up_proj"] = torch.cat(rows)
        else:
            first = "gate_up_proj" if cfg.mlp_gated else "up_proj"
            pair(o + first, p + (names.gate_up or names.up), cfg.mlp_bias)
        if cfg.qk_norm == "layer_heads":  # a LayerNorm per head: [H * D] weights
            for ours, theirs, heads in (
                ("q_norm", names.q_norm, nh),
                ("k_norm", names.k_norm, nkv),
            ):
                out[o + ours] = rot(state.pop(f"{p}{theirs}.weight").reshape(-1), heads)
        pair(o + "down_proj", p + names.down, cfg.mlp_bias)
        pair(o + "input_layernorm", p + names.input_layernorm, cfg.norm_bias)
        if cfg.parallel_block != "shared" and names.post_attention_layernorm is not None:
            pair(o + "post_attention_layernorm", p + names.post_attention_layernorm, cfg.norm_bias)
    return out


def _bias_name(weight: str) -> str:
    """Our name of the bias beside weight ``weight`` (``layers.0.o_proj`` -> ``o_bias``)."""
    owner, _, name = weight.rpartition(".")
    bias = {"o_proj": "o_bias", "up_proj": "up_bias", "gate_up_proj": "up_bias"}
    bias |= {"down_proj": "down_bias", "norm": "norm_bias", "lm_head": "lm_head_bias"}
    ours = bias.get(name, name + "_bias")
    return f"{owner}.{ours}" if owner else ours


MODEL = ClassicModel
