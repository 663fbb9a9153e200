"""The LoRA adapters a front end serves by name (vLLM's surface): ``--lora-modules``
(``name=path`` or vLLM's JSON form with ``base_model_name``), the ``model`` field that
picks one (unknown: 404 ``model_not_found``), their cards in ``/v1/models`` (``root``:
the directory, ``parent``: the base's name), and ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` with vLLM's bodies, messages and codes, routed only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or ``STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING`` is
``1``/``true``.

Each adapter is checked here (``lora.read_adapter``: its config and safetensors header
against the base's shape) before it gets a name, and carries a ``LoraRef`` to the engine
with every request, which loads it on first use (``engine.adapters``). Every load of a
name gets a fresh id, so the engine's prefix cache never mixes two loads' blocks; an
unloaded adapter still serves the requests already sent with it.

With ``--api-server-count`` above 1 the front ends share their runtime loads and
unloads through a ``Journal``: one file (a memfd the main process creates, every front
end inherits) of JSON lines, appended under a lock by the front end that answered the
call and replayed by each front end before it looks a name up, lists the cards or
answers a load or unload. A front end started later (after an engine restart) replays
it from the start.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from structllm.lora import AdapterError, AdapterMissing, read_adapter
from structllm.model.config import ModelConfig
from structllm.protocol import LoraRef
from structllm.server.errors import APIError

RUNTIME_FLAGS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "STRUCTLLM_ALLOW_RUNTIME_LORA_UPDATING")
RUNTIME_IDS = 1 << 32  # runtime loads' ids start here, per process (see ServedAdapters)


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=path``, or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``
    (``ValueError`` naming what is wrong)."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r} is not JSON: {e}") from None
        if not isinstance(raw, dict) or not {"name", "path"} <= raw.keys():
            raise ValueError(f"--lora-modules {text!r} needs a name and a path")
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown keys {unknown}")
        return LoraModule(str(raw["name"]), str(raw["path"]), raw.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoraModule(name, path)


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(k, "0").strip().lower() in ("1", "true") for k in RUNTIME_FLAGS)


class LoadLoraAdapterRequest(msgspec.Struct, frozen=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, frozen=True):
    lora_name: str = ""
    lora_int_id: int | None = None


@dataclass(frozen=True)
class Served:
    ref: LoraRef
    parent: str


class Journal:
    """The runtime loads and unloads of a server's front ends (see the module's
    docstring): JSON lines in the file ``fd``, each read once by each front end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.offset = 0  # the bytes of whole lines this front end has read

    def append(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry).encode() + b"\n"
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # one writer at a time: lines never mix
        try:
            os.pwrite(self.fd, line, os.fstat(self.fd).st_size)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def read_new(self) -> list[dict[str, Any]]:
        """The whole lines appended since the last call, in order."""
        size = os.fstat(self.fd).st_size
        if size == self.offset:
            return []
        data = os.pread(self.fd, size - self.offset, self.offset)
        end = data.rfind(b"\n") + 1  # (a line being written is read next time)
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines()]


class ServedAdapters:
    """The adapters served by name next to the base ``model_name`` (``enabled``: the
    engine runs adapters, ``--enable-lora``); ``journal``: the runtime loads shared
    with the server's other front ends."""

    def __init__(
        self,
        enabled: bool,
        model_name: str,
        cfg: ModelConfig,
        max_lora_rank: int,
        modules: tuple[LoraModule, ...] = (),
        journal: Journal | None = None,
    ) -> None:
        self.enabled, self.model_name, self.cfg = enabled, model_name, cfg
        self.max_lora_rank = max_lora_rank
        self.journal = journal
        self.by_name: dict[str, Served] = {}
        # --lora-modules take ids 1.. in order (the same in every front end); runtime
        # loads ids of this process's own (pid-based: front ends never share one)
        self._static_ids = itertools.count(1)
        self._runtime_ids = itertools.count(RUNTIME_IDS + (os.getpid() << 16))
        if modules and not enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in modules:
            if m.name == model_name or m.name in self.by_name:
                raise ValueError(f"--lora-modules: the name {m.name!r} is already served")
            parent = m.base_model_name or model_name
            if parent != model_name:
                raise ValueError(
                    f"--lora-modules {m.name}: base_model_name {parent!r} is not the served "
                    f"model {model_name!r}"
                )
            try:
                self._add(m.name, m.path, parent, next(self._static_ids))
            except AdapterError as e:
                raise ValueError(f"--lora-modules {m.name}: {e}") from None

    def _add(self, name: str, path: str, parent: str, lora_id: int) -> None:
        read_adapter(path, self.cfg, self.max_lora_rank)
        self.by_name[name] = Served(LoraRef(name, lora_id, os.path.abspath(path)), parent)

    def _sync(self) -> None:
        """Apply what the other front ends loaded and unloaded since the last look."""
        if self.journal is None:
            return
        for e in self.journal.read_new():
            if e["op"] == "load":
                ref = LoraRef(e["name"], e["id"], e["path"])
                self.by_name[e["name"]] = Served(ref, e["parent"])
            else:
                self.by_name.pop(e["name"], None)

    def ref(self, model: str | None) -> LoraRef | None:
        """The adapter a request's ``model`` names (None: the base); 404 if unknown."""
        if model is None or model == self.model_name:
            return None
        self._sync()
        served = self.by_name.get(model)
        if served is None:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`"
                + (f" and the adapters {sorted(self.by_name)}" if self.by_name else ""),
                param="model",
                code="model_not_found",
            )
        return served.ref

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (after the base's)."""
        self._sync()
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "structllm",
                "root": s.ref.path,
                "parent": s.parent,
            }
            for name, s in self.by_name.items()
        ]

    def load(self, req: LoadLoraAdapterRequest) -> str:
        """vLLM's ``/v1/load_lora_adapter``: the success text, or an ``APIError``."""
        self._sync()
        if not req.lora_name or not req.lora_path:
            raise APIError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if req.lora_name in self.by_name and not req.load_inplace:
            raise APIError(
                400,
                f"The lora adapter '{req.lora_name}' has already been loaded.",
                "InvalidUserInput",
            )
        if req.lora_name == self.model_name:
            raise APIError(400, f"'{req.lora_name}' is the base model's name", "InvalidUserInput")
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled (--enable-lora)", "BadRequestError")
        try:
            self._add(req.lora_name, req.lora_path, self.model_name, next(self._runtime_ids))
        except AdapterMissing as e:
            raise APIError(404, str(e), "NotFoundError") from None
        except AdapterError as e:
            raise APIError(400, str(e), "BadRequestError") from None
        if self.journal is not None:
            s = self.by_name[req.lora_name]
            entry = {"op": "load", "name": req.lora_name, "path": s.ref.path}
            self.journal.append({**entry, "id": s.ref.lora_id, "parent": s.parent})
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload(self, req: UnloadLoraAdapterRequest) -> str:
        """vLLM's ``/v1/unload_lora_adapter``: the success text, or an ``APIError``."""
        self._sync()
        if not req.lora_name and not req.lora_int_id:
            raise APIError(
                400,
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
                "InvalidUserInput",
            )
        if req.lora_name not in self.by_name:
            raise APIError(
                404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError"
            )
        del self.by_name[req.lora_name]
        if self.journal is not None:
            self.journal.append({"op": "unload", "name": req.lora_name})
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
