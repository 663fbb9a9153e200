"""``llama.RowGather``: a decode step's rotary rows gathered by numpy into kept buffers
are the rows torch's index gives (complex tables as their float pairs), per row count,
and follow a table that was rebuilt (grown)."""

from __future__ import annotations

import torch

from structllm.model.llama import LlamaModel, RowGather


def test_rows_equal_torch_index() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.polar(torch.ones(300, 32), torch.rand(300, 32, generator=g))  # complex64
    gather = RowGather()
    for rows in ([5], [0, 299, 7], [3, 3, 9, 100, 2, 1, 0, 250]):
        index = torch.tensor(rows, dtype=torch.int64)
        got = gather.rows("rope0", table, index)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, torch.view_as_real(table)[index])
    # the same row count reuses its buffer (rewritten), and a new table is followed
    first = gather.rows("rope0", table, torch.tensor([1]))
    second = gather.rows("rope0", table, torch.tensor([2]))
    assert second is first and torch.equal(second, torch.view_as_real(table)[[2]])
    bigger = torch.polar(torch.ones(600, 32), torch.rand(600, 32, generator=g))
    again = gather.rows("rope0", bigger, torch.tensor([599]))
    assert torch.equal(again, torch.view_as_real(bigger)[[599]])
    plain = torch.randn(50, 8, generator=g)  # a real table, gathered as is
    assert torch.equal(gather.rows("t", plain, torch.tensor([4, 2])), plain[[4, 2]])


def test_decode_rows_are_the_index_ops_rows() -> None:
    """``LlamaModel._rope_pairs`` on decode rows: the rows ``table[positions]`` gave."""
    model = LlamaModel.__new__(LlamaModel)
    model._gather = RowGather()
    model._rope_local = None
    table = torch.polar(torch.ones(64, 16), torch.rand(64, 16))
    for pos in ([10], [1, 2, 63]):
        positions = torch.tensor(pos, dtype=torch.int64)
        (got,) = model._rope_pairs(table, positions)
        assert torch.equal(got, torch.view_as_real(table[positions]))
