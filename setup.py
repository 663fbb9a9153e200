"""The C extension; everything else is in pyproject.toml.

``structllm.ipc._atomic``: acquire/release loads and stores and a full fence for the
shared-memory rings.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("structllm.ipc._atomic", ["structllm/ipc/_atomic.c"], extra_compile_args=["-O2"]),
    ]
)
