"""``server/embeddings.py``'s pure parts: the shapes ``input`` takes, the
``dimensions`` a model allows (a model without Matryoshka refuses any), and the
base64 encoding (little-endian float32, as OpenAI's)."""

from __future__ import annotations

import base64
import struct

import pytest

from structllm.protocol import PoolerInfo
from structllm.server.embeddings import check_dimensions, encode, inputs
from structllm.server.errors import APIError


def test_input_shapes() -> None:
    assert inputs("a") == ["a"]
    assert inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2, 3]) == [[1, 2, 3]]
    assert inputs([[1, 2], [3]]) == [[1, 2], [3]]
    for bad in ([], "", [""], [[]], [1.5], {"a": 1}, None, [True], [[1], "a", 3]):
        with pytest.raises(APIError) as e:
            inputs(bad)
        assert e.value.status == 400 and e.value.param == "input"


def test_dimensions_need_matryoshka() -> None:
    plain = PoolerInfo("embed", 64)
    check_dimensions(plain, None, "m")
    with pytest.raises(APIError, match="does not support matryoshka") as e:
        check_dimensions(plain, 32, "m")
    assert (e.value.status, e.value.param) == (400, "dimensions")
    listed = PoolerInfo("embed", 64, True, [16, 32, 64])
    check_dimensions(listed, 32, "m")
    with pytest.raises(APIError, match="one of"):
        check_dimensions(listed, 20, "m")


def test_base64_is_little_endian_float32() -> None:
    vec = struct.pack("=3f", 1.0, -2.5, 0.125)
    assert struct.unpack("<3f", base64.b64decode(encode(vec, "base64"))) == (1.0, -2.5, 0.125)  # type: ignore[arg-type]
    assert encode(vec, "float") == [1.0, -2.5, 0.125]
