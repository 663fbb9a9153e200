"""Deepstack (Qwen3-VL): visual features from several vision-tower layers added to the
text model's hidden states after its first layers, at the image tokens' positions.

transformers' ``Qwen3VLTextModel`` adds ``deepstack_visual_embeds[i]`` to the output of
decoder layer ``i`` (the residual stream after it) at every image position, for ``i`` in
``0 .. k - 1``. A step's prefill chunks take the rows of their own image tokens
(``engine.image_rows``), so a span split across chunks adds each row in the chunk that
holds it, as one run would: the text attention is causal, so what a row adds is read
only by itself and the rows after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class Deepstack:
    rows: Tensor  # [M] int64: the step's flat rows of image tokens
    embeds: Tensor  # [k, M, hidden]: what layer i's output gains at those rows

    def add(self, layer: int, x: Tensor) -> Tensor:
        """``x: [T, hidden]`` (layer ``layer``'s output, or the part of it the fused
        path carries as its delta) with layer ``layer``'s rows added; ``x`` itself past
        the deepstack layers. A new tensor: ``x`` may be a kernel's buffer."""
        if layer >= self.embeds.shape[0]:
            return x
        return x.index_add(0, self.rows, self.embeds[layer].to(x.dtype))


class TakesDeepstack(Protocol):
    deepstack: Deepstack | None  # LlamaModel's, read by its forward


@contextmanager
def injected(model: TakesDeepstack, rows: Deepstack | None) -> Iterator[None]:
    """``model``'s forward adds ``rows`` for the duration (nothing when None)."""
    if rows is None:
        yield
        return
    model.deepstack = rows
    try:
        yield
    finally:
        model.deepstack = None
