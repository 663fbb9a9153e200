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


# Three sequences (186, 124 and 30 rows) over steps: per step, (sequence, rows); a
# sequence's later one-row chunks run as decode rows, first chunks and longer ones as
# prefill chunks (1, 3, 17, 64, 100 rows), decodes and prefills of other slots beside
STEP_LENGTHS = [186, 124, 30]
STEPS = [
    [(0, 1), (1, 3)],
    [(0, 3), (1, 17), (2, 1)],
    [(2, 1), (0, 17), (1, 100)],
    [(2, 1), (1, 1), (0, 64)],
    [(1, 1), (2, 27), (0, 100)],
    [(0, 1), (1, 1)],
    [(1, 1)],
]


def run_steps(
    mixer: Callable[[Tensor, tuple[Tensor, ...], RecurrentBatch], Tensor],
    xs: list[Tensor],
    states: tuple[Tensor, ...],
    slot_of: list[int],
) -> list[Tensor]:
    """Each sequence of ``xs`` (``STEP_LENGTHS`` rows) through ``mixer`` as ``STEPS``
    cuts it, sequence ``i`` in slot ``slot_of[i]`` of ``states``: its rows, in order."""
    pos = [0] * len(xs)
    outs: list[list[Tensor]] = [[] for _ in xs]
    for step in STEPS:
        decodes = [(i, n) for i, n in step if n == 1 and pos[i] > 0]
        order = decodes + [(i, n) for i, n in step if (i, n) not in decodes]
        x = torch.cat([xs[i][pos[i] : pos[i] + n] for i, n in order])
        y = mixer(x, states, batch([(n, slot_of[i], pos[i] == 0) for i, n in order], len(decodes)))
        a = 0
        for i, n in order:
            outs[i].append(y[a : a + n])
            pos[i] += n
            a += n
    assert pos == [len(x) for x in xs]
    return [torch.cat(o) for o in outs]
