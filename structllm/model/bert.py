"""BERT-style encoders (``BertModel``, ``XLMRobertaModel`` and their one-label
``*ForSequenceClassification`` cross-encoders): the embedders and rerankers of RAG
(all-MiniLM-L6-v2, bge-m3, bge-reranker, ms-marco cross-encoders). Only the pooling
runner runs them (``engine.pooling``).

The classic layout's parts (``model.classic``: LayerNorms with biases, an ungated GELU
MLP with biases, biased q/k/v and output projections), arranged as BERT does:

- the input is ``LayerNorm(word + position + token type)``, the embedding's LayerNorm
  held as the decoder's final ``norm``/``norm_bias`` (there is no norm after the last
  layer: ``final_norm`` is the identity);
- each layer normalises *after* its residual sums (post-LN):
  ``x = LN_a(x + attn(x)); x = LN_m(x + mlp(x))``. The two LayerNorms keep the decoder's
  parameter names: ``post_attention_layernorm`` is ``LN_a`` (``attention.output.
  LayerNorm``), ``input_layernorm`` is ``LN_m`` (``output.LayerNorm``, the next layer's
  input);
- attention goes both ways (``ModelConfig.bidirectional``): the engine runs each prompt
  whole in one step, so there is no chunked prefill and no prefix cache, and no KV
  cache: each prompt's rows attend over its own keys in one SDPA
  (``encoder_attention``); the scheduler's KV blocks are only a bound on the tokens in
  flight (the cache tensors are empty);
- XLM-RoBERTa's positions start at ``pad_token_id + 1`` (``position_offset``);
  NomicBERT (``model.nomic_bert``) has no position table: rotary q/k instead, and a
  SwiGLU MLP without biases.

``token_type_ids`` (BERT's ``type_vocab_size`` 2): a single text is all type 0; a pair
``[CLS] a [SEP] b [SEP]`` is type 1 from ``b`` on. Where ``b`` starts is the request's
(``PoolingParams.second_at``, from the tokenizer's pair template), not read off the ids:
a literal ``[SEP]`` typed inside a text changes nothing, as with transformers. The
pooling runner sets each step's types (``step_types``) before the forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structllm.kernels.attention import AttentionImpl, AttentionMetadata
from structllm.kernels.packed import linear
from structllm.model.classic import ClassicLayer, ClassicModel
from structllm.model.collectives import TensorParallelGroup
from structllm.model.config import ModelConfig
from structllm.model.layers import apply_rope, norm
from structllm.model.sharding import ShardPlan


def _param(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# ``bias_act_``'s codes for the activations it has
_FUSED_ACTS = {"gelu": 0, "gelu_tanh": 1}


class BertLayer(ClassicLayer):
    """One post-LayerNorm encoder layer (see the module's doc for its norms' names).

    ``ops`` (``BertModel.use_cpu_ops``: the non-exact CPU formats): cpu_layer.cpp's
    fused glue runs the bias adds, GELU and each residual sum + LayerNorm on the
    kernels' pool, and its ``encoder_attention`` the attention (``encode_fused``);
    all four matmuls allow the int8 path (as llama.cpp runs every quantised matmul;
    Q8_0 ones take it where it pays, ``packed.int8_types``)."""

    ops: Any = None

    def self_attention(
        self,
        h: Tensor,
        rope: Tensor | None,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        impl: AttentionImpl,
        tp: TensorParallelGroup | None = None,
    ) -> Tensor:
        """``h [T, hidden]`` -> ``[T, hidden]``: each prompt's rows attend to all of its
        own (``encoder_attention``); nothing is cached (``k_cache``/``v_cache`` are
        ``BertModel.kv_cache_shapes``' empty tensors)."""
        t, nh, hd = h.shape[0], self.num_heads, self.head_dim
        qkv = linear(h, self.qkv_proj, self.qkv_bias).view(t, 3 * nh, hd)
        qk = qkv[:, : 2 * nh] if rope is None else apply_rope(qkv[:, : 2 * nh], rope)
        o = encoder_attention(qk[:, :nh], qk[:, nh:], qkv[:, 2 * nh :], meta, self.scale)
        return linear(o.reshape(t, nh * hd), self.o_proj, self.o_bias)

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
        """``x: [T, hidden]`` -> ``[T, hidden]``."""
        if self.ops is not None and tp is None and x.dtype == torch.float32:
            return self.encode_fused(x, rope, meta)
        x = x + self.self_attention(x, rope, k_cache, v_cache, meta, impl, tp)
        x = self._ln(x, self.post_attention_layernorm, self.post_attention_layernorm_bias)
        x = x + self.mlp(x, tp)
        return self._ln(x, self.input_layernorm, self.input_layernorm_bias)

    def encode_fused(self, x: Tensor, rope: Tensor | None, meta: AttentionMetadata) -> Tensor:
        """``forward`` with cpu_layer.cpp's glue (``x [T, hidden]`` float32): every op
        between two matmuls is one loop on the kernels' pool, each in place in the
        matmul's fresh output (the biases are added there, not by ``linear``)."""
        ops, t, nh, hd = self.ops, x.shape[0], self.num_heads, self.head_dim
        lin = partial(linear, int8_ok=True)
        qkv = lin(x, self.qkv_proj)  # [T, 3 H D]
        bias = self.qkv_bias  # added by the attention as it packs q, k, v (no pass of its own)
        if bias is not None and rope is not None:  # (rotary needs it first)
            ops.bias_add_(qkv, bias)
            bias = None
        qkv = qkv.view(t, 3 * nh, hd)
        qk = qkv[:, : 2 * nh] if rope is None else apply_rope(qkv[:, : 2 * nh], rope)
        # [T, H, D]: each prompt's rows over its own keys on the pool (cpu_layer.cpp)
        o = ops.encoder_attention(
            qk[:, :nh], qk[:, nh:], qkv[:, 2 * nh :], meta.query_start_list, self.scale, bias
        )
        a = lin(o.view(t, nh * hd), self.o_proj)
        w, b = self.post_attention_layernorm, self.post_attention_layernorm_bias
        x = ops.add_layer_norm_(a, self.o_bias, x, w, b, self.eps)
        if self.gated or self.act not in _FUSED_ACTS:  # (NomicBERT's SwiGLU)
            d, d_bias = self.mlp(x, None), None
        else:
            u = lin(x, self.up_proj)  # [T, F]
            ops.bias_act_(u, self.up_bias, _FUSED_ACTS[self.act])
            d, d_bias = lin(u, self.down_proj), self.down_bias
        w, b = self.input_layernorm, self.input_layernorm_bias
        out: Tensor = ops.add_layer_norm_(d, d_bias, x, w, b, self.eps)
        return out


def encoder_attention(
    q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """``q, k, v: [T, H, D]`` of a step of whole prompts (``meta.query_start_list``) ->
    ``[T, H, D]``, each prompt's rows over its own keys both ways (one SDPA a prompt:
    no mask, no padding, no paged cache; faster here than the paged prefill kernel's
    per-row ``ahead`` bounds, and nothing to store). The fused path runs cpu_layer.cpp's
    ``encoder_attention`` instead (``BertLayer.encode_fused``)."""
    out = torch.empty_like(q)
    starts = meta.query_start_list
    for b in range(len(starts) - 1):
        s, e = starts[b], starts[b + 1]
        # [H, n, D] each
        qb, kb, vb = (x[s:e].transpose(0, 1) for x in (q, k, v))
        out[s:e] = F.scaled_dot_product_attention(qb, kb, vb, scale=scale).transpose(0, 1)
    return out


class BertModel(ClassicModel):
    """The encoder: embeddings (word, position, token type, LayerNorm), then
    ``BertLayer``s; its output is the last layer's (no final norm, no LM head)."""

    # an F16 file's matrices on fbgemm's float16 GEMM: an encoder's steps are long
    # prompts, where fbgemm's large-M kernel is ahead of the float16 rows' (0.72-0.85x
    # its speed at 256 rows, bench/half_linear.py --rows 256)
    FILE_HALF_ROWS = False

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        plan: ShardPlan | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__(cfg, dtype, plan, layers)
        if cfg.learned_positions:  # [max positions + offset, hidden]: the whole table
            rows = cfg.max_position_embeddings + cfg.position_offset
            self.position_embeddings = _param(dtype, rows, cfg.hidden_size)
        self.token_type_embeddings = (
            _param(dtype, cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        )
        # [T] token types of the step's rows (engine.pooling.pair_types); None: all 0
        self.step_types: Tensor | None = None
        self.cuda_graphs = False  # (nothing is decoded)

    def make_layer(
        self, cfg: ModelConfig, dtype: torch.dtype, plan: ShardPlan | None, index: int
    ) -> nn.Module:
        return BertLayer(cfg, dtype, plan, index)

    def kv_cache_shapes(
        self, layer: int, num_blocks: int, block_size: int
    ) -> tuple[tuple[int, ...], ...]:
        """Empty: an encoder caches nothing (``BertLayer.self_attention``); the
        scheduler's blocks only bound the tokens in flight."""
        return (0,), (0,)

    def embed_at(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """``LayerNorm(word + position + type)`` rows ``[T, hidden]`` of a step of whole
        prompts (each starts at position 0)."""
        x = self.embed(input_ids)
        if self.position_embeddings is not None:  # (NomicBERT: rotary instead)
            x = x + self.position_embeddings[positions + self.cfg.position_offset]
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings[self.token_types(input_ids)]
        return norm(x, self.norm, self.norm_bias, self.cfg.rms_norm_eps, "layer")

    def token_types(self, input_ids: Tensor) -> Tensor:
        """``[T]``: the step's types (``step_types``), all 0 without (or with one row)."""
        types = self.step_types
        if types is None or self.token_type_embeddings is None:
            return torch.zeros_like(input_ids)
        if self.token_type_embeddings.shape[0] < 2:
            return torch.zeros_like(input_ids)
        assert types.shape == input_ids.shape, "step_types set for this step"
        return types

    def final_norm(self, x: Tensor) -> Tensor:
        return x  # (post-LN: the last layer ends normed)

    def use_cpu_ops(self) -> bool:
        """The fused glue of cpu_layer.cpp for each layer (``BertLayer.encode_fused``;
        the non-exact formats, float32 activations on CPU), and Q8_0 matrices on the
        int8 path where its kernels have VNNI (``packed.int8_types``). Returns
        whether the ops are in use. The model's own ``cpu_ops`` stays None: with it,
        ``LlamaModel.forward`` would run a decoder's fused loop."""
        from structllm.kernels import cpu_ext

        if self.norm.device.type != "cpu" or self.norm.dtype != torch.float32:
            return False
        ops = cpu_ext.load_layer()
        if ops is None:
            return False
        for layer in self.layers:
            if isinstance(layer, BertLayer):  # (a stage's others are placeholders)
                layer.ops = ops
        return True


# a checkpoint's encoder tensors (under "bert." / "roberta." in a sequence classifier,
# at the top in a bare model), ours <- theirs under encoder.layer.{i}.
_LAYER = {
    "o_proj": "attention.output.dense",
    "post_attention_layernorm": "attention.output.LayerNorm",
    "up_proj": "intermediate.dense",
    "down_proj": "output.dense",
    "input_layernorm": "output.LayerNorm",
}
_BIAS = {"o_proj": "o_bias", "up_proj": "up_bias", "down_proj": "down_bias"}
_PREFIXES = ("bert.", "roberta.", "model.")


def encoder_body(
    state: dict[str, Tensor], cfg: ModelConfig
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A checkpoint's encoder tensors with their head's prefix cut (``bert.``,
    ``roberta.``; heads and other tensors left out), and ours of its embeddings."""
    body: dict[str, Tensor] = {}
    for k, v in state.items():
        for p in _PREFIXES:
            if k.startswith(p):
                k = k[len(p) :]
                break
        if k.startswith(("embeddings.", "encoder.", "layers.")):
            body[k] = v
    e = "embeddings."
    out = {
        "embed_tokens": body.pop(e + "word_embeddings.weight"),
        "norm": body.pop(e + "LayerNorm.weight"),
        "norm_bias": body.pop(e + "LayerNorm.bias"),
    }
    if cfg.learned_positions:
        out["position_embeddings"] = body.pop(e + "position_embeddings.weight")
    if cfg.type_vocab_size:
        out["token_type_embeddings"] = body.pop(e + "token_type_embeddings.weight")
    return body, out


def hf_to_native(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A BERT / XLM-RoBERTa checkpoint's tensors -> ours; the heads (``pooler``,
    ``classifier``: a cross-encoder's, which ``engine.pooling`` reads itself) and
    masked-LM heads are left out."""
    body, out = encoder_body(state, cfg)
    for i in range(cfg.num_layers):
        p, o = f"encoder.layer.{i}.", f"layers.{i}."
        qkv = [body.pop(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value")]
        out[o + "qkv_proj"] = torch.cat(qkv)
        bias = [body.pop(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value")]
        out[o + "qkv_bias"] = torch.cat(bias)
        for ours, theirs in _LAYER.items():
            out[o + ours] = body.pop(p + theirs + ".weight")
            out[o + _BIAS.get(ours, ours + "_bias")] = body.pop(p + theirs + ".bias")
    return out


MODEL = BertModel
