"""``engine.mrope.MRopePositions`` (3-D rotary positions of a prompt with images) in
any chunking, and the config's ``mrope_section`` (``model.config``). Against
transformers' ``get_rope_index``: ``tests/engine/test_vision_qwen2_5_vl.py``."""

from __future__ import annotations

import itertools
import random

import pytest

from structllm.engine.mrope import MRopePositions
from structllm.model.config import ModelConfig

# (offset, rows, cols) of each image
GRIDS = [(3, 2, 3), (12, 1, 2), (20, 4, 1), (24, 3, 3)]


def test_positions_by_hand() -> None:
    m = MRopePositions(GRIDS[:2])
    assert m.flat(0, 16) == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 9, 11, 12]
    assert m.spatial(0, 16) == (
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 9, 11, 12],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    )
    assert m.flat(100, 102) == [97, 98]  # generated: the last image's shift (-3)
    assert m.spatial(9, 12) is None and m.spatial(100, 101) is None


def test_any_chunking_gives_the_same_positions() -> None:
    m = MRopePositions(GRIDS)
    n = 40
    flat, spatial = m.flat(0, n), m.spatial(0, n)
    assert spatial is not None
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted({0, n, *rng.sample(range(1, n), rng.randint(1, 8))})
        got_t: list[int] = []
        got_h: list[int] = []
        got_w: list[int] = []
        for a, b in itertools.pairwise(cuts):
            got_t += m.flat(a, b)
            hw = m.spatial(a, b)
            h, w = hw if hw is not None else (m.flat(a, b), m.flat(a, b))
            got_h += h
            got_w += w
        assert (got_t, got_h, got_w) == (flat, *spatial), cuts
    for axis in (flat, *spatial):  # a position never passes its token's index
        assert all(p <= i for i, p in enumerate(axis))


def test_bad_grids_are_refused() -> None:
    with pytest.raises(ValueError, match="overlap"):
        MRopePositions([(3, 2, 2), (5, 1, 1)])
    with pytest.raises(ValueError, match="0x2"):
        MRopePositions([(3, 0, 2)])


BASE = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"],
    vision_config={"depth": 1},
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=100,
)


def test_config_reads_mrope_section_from_either_layout() -> None:
    flat = ModelConfig.from_hf(
        {**BASE, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    )
    nested = ModelConfig.from_hf(
        {
            "architectures": BASE["architectures"],
            "vision_config": {},
            "text_config": {
                **{k: v for k, v in BASE.items() if k not in ("architectures", "vision_config")},
                "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            },
        }
    )
    for cfg in (flat, nested):
        assert cfg.architecture == "qwen2" and cfg.mrope_section == [2, 3, 3]
        assert cfg.rope_scaling is None and cfg.qkv_bias
    assert flat.rope_theta == 1e6  # Qwen2_5_VLTextConfig's default
    plain = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert plain.mrope_section == []


def test_config_refuses_bad_sections() -> None:
    with pytest.raises(ValueError, match="splits 9 rotary pairs, but a head has 8"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"type": "mrope", "mrope_section": [3, 3, 3]}})
    with pytest.raises(ValueError, match="three counts"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"type": "mrope", "mrope_section": [8]}})
    interleaved = ModelConfig.from_hf(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        }
    )
    assert interleaved.mrope_section == [2, 3, 3] and interleaved.mrope_interleaved
    consecutive = ModelConfig.from_hf(
        {**BASE, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    )
    assert not consecutive.mrope_interleaved


@pytest.mark.parametrize("section", [[24, 20, 20], [11, 11, 10], [2, 3, 3], [4, 2, 2]])
def test_interleaved_axes_are_transformers(section: list[int]) -> None:
    """Each rotary pair's axis as transformers' ``Qwen3VLTextRotaryEmbedding``
    recomposes the frequencies of the three axes (positions 0, 1000, 2000 tell them
    apart), and the consecutive split as Qwen2.5-VL's ``mrope_section`` cuts them."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from structllm.model.layers import mrope_axes

    pairs = sum(section)
    rope = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
    rope.mrope_section = section
    freq = torch.tensor([0.0, 1000.0, 2000.0]).view(3, 1, 1, 1).expand(3, 1, 1, pairs).clone()
    want = (rope.recomposition_frequencies(freq)[0, 0, :pairs] / 1000).long()
    assert torch.equal(mrope_axes(section, pairs, interleaved=True), want)
    t, h, _ = section
    plain = mrope_axes(section, pairs + 2, interleaved=False)
    assert plain.tolist() == [0] * t + [1] * h + [2] * section[2] + [0, 0]
