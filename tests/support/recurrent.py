"""Helpers for the recurrent mixers' tests (``test_deltanet.py``, ``test_mamba2.py``):
a step's rows as a ``RecurrentBatch``, a tolerance relative to the reference's scale,
and a transformers layer's seeded weights carried over to ours."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from structllm.model.recurrent import RecurrentBatch


def batch(seqs: list[tuple[int, int, bool]], num_decodes: int) -> RecurrentBatch:
    """A step's rows: ``(rows, slot, fresh)`` per sequence, decodes first."""
    starts = [0]
    for n, _, _ in seqs:
        starts.append(starts[-1] + n)
    slots = [s for _, s, _ in seqs]
    fresh = [f for _, _, f in seqs]
    return RecurrentBatch(
        starts,
        slots,
        torch.tensor(slots, dtype=torch.long),
        fresh,
        torch.tensor(fresh, dtype=torch.bool),
        num_decodes,
    )


def close(a: Tensor, b: Tensor, rel: float = 1e-5) -> None:
    """``a`` within ``rel`` of ``b``'s largest magnitude (or of 1)."""
    err = (a - b).abs().max().item()
    assert err <= rel * max(b.abs().max().item(), 1.0), err


def seed_weights(layer: nn.Module, seed: int, a_range: tuple[float, float]) -> nn.Module:
    """``layer`` (transformers' mixer, in eval mode) with seeded weights in the ranges a
    trained one has: ``A_log`` the log of a decay rate in ``a_range``, the gated norm's
    weight near 1, matrices small."""
    torch.manual_seed(seed)
    layer.eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(*a_range).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    return layer


def carried_over(
    ours: nn.Module, hf: nn.Module, from_hf: Callable[[dict[str, Tensor], str], dict[str, Tensor]]
) -> nn.Module:
    """``ours`` with ``hf``'s weights, through the loader's ``from_hf`` (which must take
    every tensor)."""
    state = {f"x.{k}": t.detach().clone() for k, t in hf.state_dict().items()}
    ours.load_state_dict(from_hf(state, "x."), strict=True)
    assert not state  # every tensor taken
    return ours
