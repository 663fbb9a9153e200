"""LoRA adapters' files, read and checked without torch (the front end checks an adapter
before it names it; the engine loads what the same check accepted, ``model.lora``).

A PEFT directory: ``adapter_config.json`` and ``adapter_model.safetensors`` (whose
header, a JSON table of names, dtypes and shapes, is all this module reads); or a
llama.cpp GGUF LoRA file (``convert_lora_to_gguf.py``'s: ``general.type = adapter``,
``adapter.lora.alpha``, ``blk.N.<tensor>.weight.lora_a`` / ``.lora_b``, F32/F16/BF16),
read with the ``gguf`` package's reader (metadata and shapes; no tensor data). Accepted:
``r``, ``lora_alpha``, rsLoRA (``use_rslora``: ``alpha / sqrt(r)`` instead of
``alpha / r``), ``rank_pattern`` / ``alpha_pattern`` (PEFT's matching: a pattern names a
module when it matches the end of its dotted name), on the attention projections
(q/k/v/o) and the gated MLP's (gate/up/down) of the dense families whose layers are the
plain ``DecoderLayer``. Refused by name, as vLLM does: DoRA, biases, ``modules_to_save``
(an embedding or head trained whole), LoRA on the embedding or head, any other module,
a rank above ``max_lora_rank``, and shapes that are not the base's.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structllm.model.config import ModelConfig
from structllm.protocol import LoraRef

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the families whose layers are the plain DecoderLayer with PEFT's module names
LORA_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_DTYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle of an adapter: ``LLM.generate(..., lora_request=...)``.
    ``lora_int_id`` must be unique to these files (positive)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")

    def ref(self) -> LoraRef:
        return LoraRef(self.lora_name, self.lora_int_id, self.lora_path)


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names what and why."""


class AdapterMissing(AdapterError):
    """No adapter at the path given."""


@dataclass(frozen=True)
class Target:
    """One adapted module of one layer: ``A [rank, in]`` and ``B [out, rank]`` stored
    under ``a_key`` / ``b_key``; its output is ``scale * B (A x)``."""

    layer: int
    module: str  # one of MODULES
    rank: int
    scale: float
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: where its weights are and what they adapt; ``gguf``: a GGUF
    LoRA file (``path``), else a PEFT directory."""

    path: Path
    targets: tuple[Target, ...]
    gguf: bool = False

    @property
    def max_rank(self) -> int:
        return max(t.rank for t in self.targets)

    @property
    def weights_file(self) -> Path:
        return self.path if self.gguf else self.path / WEIGHTS_FILE


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """``(out, in)`` of the base's ``module`` (one of ``MODULES``)."""
    h, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }[module]


def check_base(cfg: ModelConfig) -> None:
    """``AdapterError`` unless adapters can run over this base model."""
    if cfg.architecture not in LORA_FAMILIES:
        raise AdapterError(
            f"LoRA adapters are supported on {', '.join(sorted(LORA_FAMILIES))} models, "
            f"not {cfg.architecture}"
        )


def read_adapter(path: str | Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """The adapter in PEFT directory ``path``, checked against the base ``cfg`` and
    ``max_lora_rank``; ``AdapterError`` naming the problem otherwise."""
    check_base(cfg)
    root = Path(path)
    if root.is_file() and root.suffix == ".gguf":
        return _read_gguf(root, cfg, max_lora_rank)
    if not (root / CONFIG_FILE).is_file():
        raise AdapterMissing(f"No adapter found at {root} (no {CONFIG_FILE})")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"no readable {CONFIG_FILE} in {root}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{root / CONFIG_FILE} is not a JSON object")
    _check_config(config)
    header = _safetensors_header(root / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"unsupported tensor {key!r} in the adapter: {_what(key)}")
        layer, module, side = int(m[1]), m[2], m[3]
        if module not in MODULES:
            raise AdapterError(
                f"LoRA on {module!r} is not supported (only {', '.join(MODULES)}); tensor {key!r}"
            )
        if layer >= cfg.num_layers:
            raise AdapterError(f"tensor {key!r}: the base has {cfg.num_layers} layers")
        if info.get("dtype") not in _DTYPES:
            raise AdapterError(f"tensor {key!r} has dtype {info.get('dtype')}; F32/F16/BF16 only")
        pairs.setdefault((layer, module), {})[side] = key
    if not pairs:
        raise AdapterError(f"the adapter in {root} has no LoRA weights")
    targets = [
        _target(cfg, config, header, layer, module, keys, max_lora_rank)
        for (layer, module), keys in sorted(pairs.items())
    ]
    return AdapterSpec(root, tuple(targets))


# llama.cpp's tensor names -> PEFT's modules
GGUF_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def _read_gguf(path: Path, cfg: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """A GGUF LoRA file's adapter (see the module's docstring), checked like a PEFT one;
    the scale is ``alpha / r`` (llama.cpp's; 1 when the file's alpha is 0)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises what it meets
        raise AdapterError(f"{path} is not a readable GGUF file: {e}") from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise AdapterError(f"{path} is not a GGUF LoRA adapter (general.type = adapter)")
    alpha = float(field("adapter.lora.alpha") or 0.0)
    pairs: dict[tuple[int, str], dict[str, Any]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m[2] not in GGUF_MODULES:
            raise AdapterError(f"unsupported tensor {t.name!r} in the GGUF adapter")
        if t.tensor_type.name not in _DTYPES:
            raise AdapterError(f"tensor {t.name!r} is {t.tensor_type.name}; F32/F16/BF16 only")
        layer = int(m[1])
        if layer >= cfg.num_layers:
            raise AdapterError(f"tensor {t.name!r}: the base has {cfg.num_layers} layers")
        pairs.setdefault((layer, GGUF_MODULES[m[2]]), {})[m[3].upper()] = t
    if not pairs:
        raise AdapterError(f"the GGUF adapter {path} has no LoRA weights")
    targets = []
    for (layer, module), ts in sorted(pairs.items()):
        name = f"model.layers.{layer}.{module}"
        if set(ts) != {"A", "B"}:
            raise AdapterError(f"{name} lacks its lora_a or lora_b")
        a, b = (list(reversed([int(n) for n in ts[s].shape])) for s in "AB")  # numpy order
        rank = _check_shapes(cfg, name, module, a, b, max_lora_rank)
        scale = alpha / rank if alpha else 1.0
        targets.append(Target(layer, module, rank, scale, ts["A"].name, ts["B"].name))
    return AdapterSpec(path, tuple(targets), gguf=True)


def _check_shapes(
    cfg: ModelConfig, name: str, module: str, a: list[int], b: list[int], max_lora_rank: int
) -> int:
    """The rank of ``A`` (shape ``a``) and ``B`` (shape ``b``) if they fit the base's
    ``module`` and ``max_lora_rank``; ``AdapterError`` otherwise."""
    out, inp = module_shape(cfg, module)
    rank = a[0] if len(a) == 2 else -1
    if len(a) != 2 or len(b) != 2 or a[1] != inp or b != [out, rank]:
        raise AdapterError(
            f"{name}: lora_A {a} and lora_B {b} do not fit the base's [{out}, {inp}] "
            f"(expected [r, {inp}] and [{out}, r]); is it an adapter of another model?"
        )
    if rank > max_lora_rank:
        raise AdapterError(f"{name} has rank {rank}, above max_lora_rank {max_lora_rank}")
    return rank


def _check_config(config: dict[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError("LoRA adapters with biases (bias / lora_bias) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save {config['modules_to_save']} is not supported (modules "
            "trained whole, such as the embedding or the LM head)"
        )
    if config.get("target_parameters"):
        raise AdapterError("target_parameters (LoRA on expert parameters) is not supported")


def _what(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA adapters are not supported"
    if key.endswith(".bias"):
        return "LoRA biases are not supported"
    if "embed" in key or "lm_head" in key:
        return "LoRA on the embedding or the LM head is not supported"
    return "not a LoRA A/B weight of a decoder layer"


def _pattern_value(patterns: dict[str, Any], name: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: the first pattern matching the end of ``name``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return float(value)
    return default


def _target(
    cfg: ModelConfig,
    config: dict[str, Any],
    header: dict[str, Any],
    layer: int,
    module: str,
    keys: dict[str, str],
    max_lora_rank: int,
) -> Target:
    name = f"model.layers.{layer}.{module}"
    if set(keys) != {"A", "B"}:
        missing = "".join(sorted({"A", "B"} - set(keys)))
        raise AdapterError(f"{name} has no lora_{missing} weight")
    a, b = header[keys["A"]]["shape"], header[keys["B"]]["shape"]
    rank = _check_shapes(cfg, name, module, a, b, max_lora_rank)
    want = _pattern_value(config.get("rank_pattern") or {}, name, float(config.get("r", rank)))
    if int(want) != rank:
        raise AdapterError(f"{name} has rank {rank}, but the adapter's config says {int(want)}")
    alpha = _pattern_value(
        config.get("alpha_pattern") or {}, name, float(config.get("lora_alpha", rank))
    )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Target(layer, module, rank, scale, keys["A"], keys["B"])


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8 bytes of little-endian length, then it)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a readable safetensors file")
    return header
