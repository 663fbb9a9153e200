"""LoRA adapters for the tests: made by ``peft`` over a tiny checkpoint, with random A
and B (``init_lora_weights=False``), cached beside it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(base: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


def peft_adapter(base: Path, seed: int, **lora: Any) -> Path:
    """A PEFT directory for checkpoint ``base``: ``LoraConfig(**lora)`` (by default rank 8,
    alpha 16, every projection) with weights drawn from ``seed``, built once and cached
    beside ``base`` by its settings."""
    kw: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES, **lora}
    key = hashlib.sha256(json.dumps([seed, kw], sort_keys=True).encode()).hexdigest()[:12]
    out = base.parent / f"{base.name}-lora-{key}"
    if (out / "adapter_model.safetensors").exists():
        return out
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), LoraConfig(init_lora_weights=False, **kw))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def peft_model(base: Path, adapter: Path) -> Any:
    """transformers' model of ``base`` with ``adapter`` applied by ``peft`` (unmerged)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(base), str(adapter)).eval()
