"""The pooling runner: embeddings (and scores) instead of tokens.

A pooling request (``AddRequest.pooling``) is prefill only: the scheduler runs its
prompt in chunks under the step's token budget beside other requests (many short inputs
share one step), nothing is sampled, and the step whose chunk reaches the prompt's end
pools the last layer's normed hidden states into one vector (``model.pooler_config``'s
``PoolerSpec``):

- ``LAST``: the last token's row (a decoder embedding: Qwen3-Embedding appends its end
  token for this). Only the last chunk's last row is needed, so chunked prefill and the
  prefix cache serve it as they serve generation (the engine always computes a prompt's
  last token).
- ``CLS``: the first token's row; ``MEAN``: the mean over every prompt row. These need
  rows of earlier chunks, kept per request between steps (``_partial``); the engine
  turns the prefix cache off for them, since a cached block's rows are never computed.

Then sentence-transformers' ``Dense`` layers, the Matryoshka cut (``dimensions``) and
normalisation, in that order; the vector goes to the front end as float32 bytes in the
request's last ``TokenDelta`` (``pooled``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import replace

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from structllm.engine.request import Request
from structllm.engine.runner import ModelRunner, StepResults
from structllm.engine.scheduler import SchedulerOutput
from structllm.kernels.attention import AttentionMetadata
from structllm.model.bert import BertModel
from structllm.model.files import ModelFiles
from structllm.model.llama import LlamaModel
from structllm.model.pooler_config import Dense, PoolerSpec
from structllm.model.registry import ENCODERS
from structllm.protocol import PoolingParams, TokenDelta


class Pooler:
    """A ``PoolerSpec``'s arithmetic after the pooled row: for an embedding the Dense
    layers (float32, loaded from their sentence-transformers folders), the cut and the
    normalisation; for a score the classifier and its sigmoid (``Scorer``)."""

    def __init__(
        self, spec: PoolerSpec, device: torch.device, scorer: Scorer | None = None
    ) -> None:
        self.spec = spec
        self.dense = [self._load(d, device) for d in spec.dense]
        self.scorer = scorer

    @staticmethod
    def _load(d: Dense, device: torch.device) -> tuple[Tensor, Tensor | None, str]:
        """A Dense layer's float32 ``W [out, in]`` and bias, from its safetensors or,
        dequantised, from the GGUF file."""
        if d.weights.endswith(".gguf"):
            w, b = _gguf_tensor(d.weights, d.tensor), None
        else:
            from safetensors.torch import load_file

            state = load_file(d.weights)
            w = state["linear.weight"]
            b = state["linear.bias"].to(device, torch.float32) if d.bias else None
        w = w.to(device, torch.float32)
        if tuple(w.shape) != (d.out_features, d.in_features):
            raise ValueError(
                f"{d.weights}: {d.tensor} is {list(w.shape)}, config says "
                f"[{d.out_features}, {d.in_features}]"
            )
        return w, b, d.activation

    def finish(self, rows: Tensor, params: list[PoolingParams]) -> list[bytes]:
        """``rows``: ``[B, H]`` in the model's dtype, one pooled row per request -> each
        request's vector as float32 bytes (a score: one float)."""
        if self.scorer is not None:
            scores = self.scorer(rows)  # [B] float32
            return [scores[i : i + 1].cpu().numpy().tobytes() for i in range(len(params))]
        x = rows.float()
        for w, b, act in self.dense:  # [B, in] -> [B, out]
            x = F.linear(x, w, b)
            if act == "tanh":
                x = torch.tanh(x)
        out: list[bytes] = []
        for i, p in enumerate(params):
            v = x[i, : p.dimensions] if p.dimensions is not None else x[i]
            normalize = self.spec.normalize if p.normalize is None else p.normalize
            if normalize:  # (sentence-transformers' F.normalize: p=2, eps=1e-12)
                v = F.normalize(v, dim=-1)
            out.append(v.to("cpu", torch.float32).contiguous().numpy().tobytes())
        return out


class Scorer:
    """A reranker's relevance from its pooled rows ``[B, H]``: ``sigmoid`` of the
    classifier's one logit (``score.weight [1, H]`` of a sequence classifier; an
    encoder's ``out(tanh(dense(row)))``, its ``head``), or of the causal LM's ``yes``
    logit minus its ``no`` logit (Qwen3-Reranker)."""

    def __init__(
        self,
        weight: Tensor | None,
        logits: Callable[[Tensor], Tensor],
        token_ids: list[int],
        head: EncoderHead | None = None,
    ) -> None:
        self.weight = weight  # [1, H] float32, or None: the LM head's two rows
        self.logits = logits  # the model's compute_logits: [B, H] -> [B, V] float32
        self.token_ids = token_ids  # [no, yes]
        self.head = head

    def __call__(self, rows: Tensor) -> Tensor:
        if self.head is not None:
            return torch.sigmoid(self.head(rows.float()))
        if self.weight is not None:
            return torch.sigmoid(F.linear(rows.float(), self.weight)[:, 0])
        no, yes = self.token_ids
        logits = self.logits(rows)  # [B, V]: the LM head's dtype and path, as generation's
        return torch.sigmoid(logits[:, yes] - logits[:, no])


class EncoderHead:
    """A BERT / XLM-RoBERTa cross-encoder's classifier on its first row, float32:
    ``out(tanh(dense(row)))`` (BERT's ``pooler.dense`` then ``classifier``; XLM-R's
    ``classifier.dense`` then ``classifier.out_proj``; a GGUF file's ``cls`` then
    ``cls.output``), one label. ``dense`` None: ``out(row)`` alone, what llama.cpp's
    graph does with a file without ``cls`` (its converter leaves BERT's pooler out)."""

    # (dense, out) as each family names them
    NAMES = (
        ("bert.pooler.dense", "classifier"),
        ("classifier.dense", "classifier.out_proj"),
    )

    def __init__(
        self, name: str, dense: tuple[Tensor, Tensor] | None, out: tuple[Tensor, Tensor]
    ) -> None:
        self.dense = dense  # [H, H], [H]
        self.out = out  # [1, H], [1]
        if self.out[0].shape[0] != 1:
            raise ValueError(f"{name}: a classifier of {self.out[0].shape[0]} labels")

    @classmethod
    def load(cls, files: ModelFiles, device: torch.device) -> EncoderHead:
        """The head from the checkpoint's safetensors or the GGUF file."""
        if files.source is not None:
            return cls._from_gguf(files, device)
        from safetensors import safe_open

        state: dict[str, Tensor] = {}
        for f in files.weights:
            with safe_open(str(f), "pt") as st:
                for k in list(st.keys()):
                    if k.startswith(("bert.pooler.", "classifier.")):
                        state[k] = st.get_tensor(k).to(device, torch.float32)
        names = next(((d, o) for d, o in cls.NAMES if f"{o}.weight" in state), None)
        if names is None or f"{names[0]}.weight" not in state:
            raise ValueError(f"{files.name} has no classifier: not a cross-encoder checkpoint")
        d, o = names
        dense = (state[f"{d}.weight"], state[f"{d}.bias"])
        return cls(files.name, dense, (state[f"{o}.weight"], state[f"{o}.bias"]))

    @classmethod
    def _from_gguf(cls, files: ModelFiles, device: torch.device) -> EncoderHead:
        from gguf import GGUFReader

        path = str(files.source)
        names = {t.name for t in GGUFReader(path).tensors}

        def pair(prefix: str) -> tuple[Tensor, Tensor]:
            w = _gguf_tensor(path, f"{prefix}.weight").to(device, torch.float32)
            if w.dim() == 1:  # [H]: a one-label classifier [1, H] as llama-quantize writes
                w = w.unsqueeze(0)  # it (ggml's dimensions, trailing 1s dropped)
            has_bias = f"{prefix}.bias" in names
            b = _gguf_tensor(path, f"{prefix}.bias") if has_bias else torch.zeros(w.shape[0])
            return w, b.reshape(-1).to(device, torch.float32)

        dense = pair("cls") if "cls.weight" in names else None
        if dense is None:
            sys.stderr.write(
                f"structllm: {files.name}: no cls tensor (llama.cpp's converter leaves BERT's "
                "pooler out): scores come from the classifier on the first row, as "
                "llama.cpp's, not as the checkpoint's CrossEncoder\n"
            )
        return cls(files.name, dense, pair("cls.output"))

    def __call__(self, rows: Tensor) -> Tensor:
        """``rows [B, H]`` float32 -> the logits ``[B]``."""
        x = rows if self.dense is None else torch.tanh(F.linear(rows, *self.dense))
        return F.linear(x, *self.out)[:, 0]


def _gguf_tensor(path: str, name: str) -> Tensor:
    """Tensor ``name`` of GGUF file ``path``, dequantised to float32 (its numpy shape:
    ggml's dimensions reversed, ``[out, in]`` for a matrix)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next((t for t in GGUFReader(path).tensors if t.name == name), None)
    if t is None:
        raise ValueError(f"{path} has no tensor {name}")
    data = dequantize(t.data, t.tensor_type).astype(np.float32)
    return torch.from_numpy(data.reshape([int(n) for n in reversed(t.shape)]).copy())


def _rank_weight(files: ModelFiles, device: torch.device) -> Tensor:
    """A GGUF reranker's classifier ``[1, H]``: its ``cls.output`` rows by their labels
    (``{arch}.classifier.output_labels``): ``yes`` minus ``no`` (Qwen3-Reranker's, so
    the score is ``sigmoid(yes - no)`` as from the directory), or the one row."""
    from gguf import GGUFReader

    assert files.source is not None, "a GGUF file's"
    w = _gguf_tensor(str(files.source), "cls.output.weight")  # [labels, H]
    fields = GGUFReader(str(files.source)).fields
    key = next((k for k in fields if k.endswith(".classifier.output_labels")), None)
    labels = [str(x) for x in fields[key].contents()] if key is not None else []
    if w.shape[0] == 1:
        return w.to(device, torch.float32)
    if sorted(labels) != ["no", "yes"] or w.shape[0] != 2:
        raise ValueError(f"{files.name}: a classifier of labels {labels} is not supported")
    yes, no = w[labels.index("yes")], w[labels.index("no")]
    return (yes - no)[None].to(device, torch.float32)


def make_scorer(
    spec: PoolerSpec, files: ModelFiles, model: LlamaModel, device: torch.device
) -> Scorer | None:
    """The scorer a reranker's ``spec`` asks for (None for an embedding model):
    ``score.weight`` read from the checkpoint's files, or the ids of the two tokens."""
    if spec.task != "score":
        return None
    if spec.classifier == "yes_no":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(files.tokenizer_json))
        ids = [tok.token_to_id(t) for t in spec.classifier_tokens]
        missing = [t for t, i in zip(spec.classifier_tokens, ids, strict=True) if i is None]
        if missing:
            raise ValueError(f"classifier_from_token {missing} are not tokens of this tokenizer")
        return Scorer(None, model.compute_logits, [i for i in ids if i is not None])
    if model.cfg.architecture in ENCODERS:
        return Scorer(None, model.compute_logits, [], EncoderHead.load(files, device))
    if spec.classifier == "rank":
        return Scorer(_rank_weight(files, device), model.compute_logits, [])
    from safetensors import safe_open

    for f in files.weights:
        with safe_open(str(f), "pt") as st:
            if "score.weight" in list(st.keys()):
                w = st.get_tensor("score.weight").to(device, torch.float32)  # [1, H]
                return Scorer(w, model.compute_logits, [])
    raise ValueError(f"{files.name} has no score.weight: not a sequence classifier checkpoint")


class PoolingRunner(ModelRunner):
    """A ``ModelRunner`` whose steps pool instead of sampling (see the module's doc).
    One process only (the engine refuses tensor and pipeline parallelism with it)."""

    pooler: Pooler
    # request id -> what earlier chunks left: CLS's first row, MEAN's sum of rows ([H])
    _partial: dict[str, Tensor]
    _pooled: dict[str, bytes]  # request id -> its vector, until its delta carries it

    def set_pooler(self, pooler: Pooler) -> None:
        self.pooler = pooler
        self._partial = {}
        self._pooled = {}

    def execute(
        self, sched: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> StepResults:
        """Run ``sched``'s prompt chunks and pool those that end their prompt; nothing is
        sampled (the scheduler finishes a prompt-only request once it is computed)."""
        batch = self.prepare(sched)
        if self.model.cfg.bidirectional:
            batch.meta = both_ways(batch.meta, self.model.cfg.sliding_window or 0)
        # prepare's layout: 1-token chunks first (as decode rows), then the others
        ordered = sorted(sched.scheduled, key=lambda rn: rn[1] != 1)
        starts = batch.step.query_start
        if isinstance(self.model, BertModel):
            self.model.step_types = pair_types(ordered, starts, batch.input_ids)
        with torch.inference_mode():
            hidden = self.model(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta, between_layers
            )  # [T, H], after the final norm
            done: list[tuple[Request, Tensor]] = []
            for i, (req, n) in enumerate(ordered):
                row = self._pool_chunk(req, n, hidden[starts[i] : starts[i] + n])
                if row is not None:
                    done.append((req, row))
            if done:
                rows = torch.stack([r for _, r in done])
                params = [_params(req) for req, _ in done]
                for (req, _), vec in zip(done, self.pooler.finish(rows, params), strict=True):
                    self._pooled[req.request_id] = vec
        return {}, {}, {}

    def _pool_chunk(self, req: Request, n: int, rows: Tensor) -> Tensor | None:
        """Fold one chunk's rows (``[n, H]``, prompt positions ``num_computed_tokens``
        on) into ``req``'s pooling; its pooled row once the chunk ends the prompt."""
        start = req.num_computed_tokens
        last = start + n == req.prompt_len
        kind = self.pooler.spec.pooling_type
        if kind == "LAST":
            return rows[-1] if last else None
        rid = req.request_id
        if start == 0:  # (again after a preemption: recomputed from the start)
            self._partial.pop(rid, None)
        if kind == "CLS":
            first = self._partial.setdefault(rid, rows[0])
            if last:
                del self._partial[rid]
            return first if last else None
        total = rows.float().sum(0)  # MEAN
        if rid in self._partial:
            total = total + self._partial[rid]
        if not last:
            self._partial[rid] = total
            return None
        self._partial.pop(rid, None)
        return (total / req.prompt_len).to(rows.dtype)

    def attach(self, deltas: Iterable[TokenDelta]) -> list[TokenDelta]:
        """``deltas`` with each pooled vector on its request's last delta."""
        out = []
        for d in deltas:
            vec = self._pooled.pop(d.request_id, None)
            out.append(d if vec is None else msgspec.structs.replace(d, pooled=vec))
        return out

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what aborted requests left here."""
        for rid in request_ids:
            self._partial.pop(rid, None)
            self._pooled.pop(rid, None)


def pair_types(ordered: list[tuple[Request, int]], starts: list[int], input_ids: Tensor) -> Tensor:
    """``[T]`` token types of a step's rows: 1 from each pair's second text on
    (``PoolingParams.second_at``, at prompt positions from the chunk's start), else 0."""
    types = torch.zeros(input_ids.shape[0], dtype=torch.long)
    for i, (req, n) in enumerate(ordered):
        at = _params(req).second_at
        if at:
            first = starts[i] + max(at - req.num_computed_tokens, 0)
            types[first : starts[i] + n] = 1
    return types.to(input_ids.device)


def both_ways(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` for a bidirectional model's step of whole prompts (the scheduler's
    ``whole_prompts``): each prefill row also sees every key after it in its prompt
    (``ahead``), and in the windowed layers those less than ``window`` away
    (``windowed``), transformers' symmetric window. Decode rows (1-token prompts) see
    only themselves already."""
    nd, starts = meta.num_decodes, meta.query_start_list
    ahead: list[int] = [0] * starts[nd]
    for b in range(nd, len(starts) - 1):
        n = starts[b + 1] - starts[b]
        assert n == meta.seq_lens_list[b], "a bidirectional prompt runs whole"
        ahead += range(n - 1, -1, -1)  # row r of n sees n - 1 - r keys ahead
    seqs = frozenset(range(nd, len(starts) - 1))
    full = torch.tensor(ahead, dtype=torch.long, device=meta.seq_lens.device)
    windowed = None
    if window:
        windowed = replace(meta, ahead=full.clamp(max=window - 1), ahead_seqs=seqs)
    return replace(meta, ahead=full, ahead_seqs=seqs, windowed=windowed)


def _params(req: Request) -> PoolingParams:
    p = req.pooling
    assert p is not None, "a pooling runner's request carries its PoolingParams"
    return p
