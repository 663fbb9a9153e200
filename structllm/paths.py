"""Where structllm keeps what it derives from models and builds: one cache directory.

``STRUCTLLM_CACHE_DIR`` overrides it; otherwise ``$XDG_CACHE_HOME/structllm`` (by
default ``~/.cache/structllm``). Converted GGUF files and compiled kernels live there.
Kept free of other structllm imports, so that any module can use it without a cycle.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("STRUCTLLM_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "structllm"
