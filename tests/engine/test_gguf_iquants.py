"""IQ4_XS files as ``llama-quantize`` writes them: the matrices run from the file's own
super-blocks (``cpu_iquants.h``), their held bytes are the file's, the model's logits
agree with its own float32 dequantisation (the float path to float32 rounding, the
default 8-bit activations within the bound they are allowed), and decode steps take the
native layer loop with the Python loop's results.

The file: a tiny random llama whose dimensions are multiples of 256 (so every matrix
really is IQ4_XS; the default model's 576-wide ones fall back to IQ4_NL), converted by
llama.cpp's converter, cached; the tests skip with the reason where llama.cpp's tools
cannot be built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.kernels import packed
from structllm.kernels.packed import BlockWeight, MixedWeight
from structllm.model import gguf as our_gguf
from structllm.model.llama import LlamaModel
from tests.engine.test_decode_plan import both_paths
from tests.support import llamacpp
from tests.support.models import prefill_logits

pytestmark = pytest.mark.skipif(
    not __import__("structllm.kernels.cpu_ext", fromlist=["x"]).best_isa(),
    reason="the block kernels need an AVX2/FMA/F16C CPU",
)


@pytest.fixture(scope="module")
def iq4xs_file(tmp_path_factory: pytest.TempPathFactory, default_files: object) -> Path:
    """A tiny random llama (hidden 256, MLP 512: whole super-blocks) as IQ4_XS."""
    from tests.support.models import make_tiny_hf_dir

    hf = make_tiny_hf_dir(
        tmp_path_factory.mktemp("iq256"),
        default_files,  # type: ignore[arg-type]
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    try:
        return llamacpp.quantize(llamacpp.convert_hf(hf, "f32"), "IQ4_XS")
    except llamacpp.ToolMissing as e:
        pytest.skip(f"llama.cpp's tools are unavailable: {e}")


def engine(model: Path, **kw: object) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(model), kv_cache_memory=32 << 20, kv_cache_dtype="float32", **kw)  # type: ignore[arg-type]
    )


def iq4xs_parts(model: LlamaModel) -> list[BlockWeight]:
    """The IQ4_XS parts of the model's matrices: its layers', embedding and head."""
    ws = [getattr(layer, n) for layer in model.layers for n in LlamaModel.LINEARS]
    assert all(isinstance(w, BlockWeight) for w in ws)
    ws += [w for w in (model.embed_tokens, model.lm_head) if isinstance(w, BlockWeight)]
    parts = [p for w in ws for p in (w.parts if isinstance(w, MixedWeight) else [w])]
    return [p for p in parts if p.type_name == "IQ4_XS"]


def test_iq4xs_matrices_hold_the_files_bytes(
    iq4xs_file: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every IQ4_XS tensor loads as its own bytes, and the model's IQ4_XS matrices hold
    exactly as many bytes as the file's IQ4_XS tensors: nothing repacked, nothing
    dequantised."""
    reader = our_gguf.open_gguf(iq4xs_file)
    file_bytes = 0
    for t in reader.tensors:
        if t.tensor_type.name != "IQ4_XS":
            continue
        shape = tuple(int(s) for s in reversed(t.shape))
        w = our_gguf.read_tensor(t, shape, keep_blocks=True)
        assert isinstance(w, BlockWeight) and w.type_name == "IQ4_XS"
        assert np.array_equal(
            w.raw.numpy().reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)
        )
        file_bytes += int(t.n_bytes)
    assert file_bytes > 0
    eng = engine(iq4xs_file)
    err = capfd.readouterr().err
    assert "IQ4_XS" in next(x for x in err.splitlines() if "weights: blocks:" in x)
    assert "dequantised" not in err, err
    model = eng.runner.model
    assert isinstance(model, LlamaModel)
    held = sum(p.nbytes for p in iq4xs_parts(model))
    eng.close()
    assert held == file_bytes


def test_logits_agree_with_the_files_dequantisation(
    iq4xs_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the float32 model of the same weights (``--quantization none``: gguf's
    dequantisation): the float path to float32 rounding, the default (8-bit activations
    per 32 in every IQ4_XS matmul) within 3%."""
    ids = list(range(100, 164))
    ref = engine(iq4xs_file, quantization="none")
    want = prefill_logits(ref, ids)
    ref.close()
    eng = engine(iq4xs_file)
    default = prefill_logits(eng, ids)
    monkeypatch.setattr(packed, "INT16_MIN_M", 0)
    monkeypatch.setattr(packed, "INT8_MIN_M", 0)
    exact = prefill_logits(eng, ids)
    eng.close()

    def rel(got: torch.Tensor) -> float:
        return ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()

    print(
        f"\nIQ4_XS logits against float32: float path {rel(exact):.1e}, default {rel(default):.1e}"
    )
    assert rel(exact) < 1e-4, rel(exact)
    assert rel(default) < 3e-2, rel(default)


def test_decode_steps_take_the_native_loop(iq4xs_file: Path) -> None:
    """The native decode loop (cpu_decode.cpp) takes IQ4_XS matrices and gives the
    Python loop's hidden states and caches bit for bit, one row and several."""
    eng = engine(iq4xs_file)
    try:
        model = eng.runner.model
        assert isinstance(model, LlamaModel) and iq4xs_parts(model)
        both_paths(eng, [13])
        both_paths(eng, [1, 40, 9], torch.float16)
    finally:
        eng.close()
