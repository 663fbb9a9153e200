"""Executes one scheduled step: builds the flat batch, runs the model, samples.

Owns the KV cache tensors (one ``[NB, BS, Hkv, D]`` pair per layer, in the KV cache
dtype, zeroed so that masked padding slots never hold NaN; with tensor parallelism,
``Hkv`` is this rank's KV heads). A step is described once, on rank 0, as a
``StepInput`` (the wire form, see ``protocol``); every rank builds its tensors from
that same description, so all ranks run the model on identical inputs.

The logits of a step's ``logit_rows`` (the sampling rows, then the rows of prompt
positions to score, see ``prompt_logprobs``) are computed ``LOGIT_SLICE`` rows at a
time on every rank alike (with tensor parallelism each slice is one gather to rank 0),
which bounds the ``[rows, V]`` float32 logits a long scored prompt chunk would need.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass, field, replace

import msgspec
import torch
from torch import Tensor

from structllm.engine.adapters import AdapterRegistry
from structllm.engine.cuda_graphs import DecodeGraphs
from structllm.engine.decode_batch import DecodeBatch
from structllm.engine.encoder_cache import EncoderCache
from structllm.engine.grammar import GrammarManager, GrammarMask
from structllm.engine.image_rows import Chunk, ImageRows, image_rows
from structllm.engine.mrope import Spatial, mrope_rows
from structllm.engine.prompt_logprobs import PromptScorer, PromptSpan
from structllm.engine.request import Request
from structllm.engine.sampler import Sampler
from structllm.engine.scheduler import SchedulerOutput
from structllm.engine.speculative import DraftRow, SampleRow, accept
from structllm.engine.stage_sampling import (
    StageFeed,
    StageSampler,
    packed_size,
    stage_budget,
    unpack,
)
from structllm.kernels.attention import AttentionMetadata
from structllm.model import decode_plan
from structllm.model.collectives import TensorParallelGroup
from structllm.model.deepstack import injected
from structllm.model.llama import LlamaModel
from structllm.model.lora import LoraRows, active
from structllm.model.vision import VisionModel
from structllm.protocol import StepInput, TokenLogprobs

LOGIT_SLICE = 256  # logit rows computed at once: [256, V] float32 (50 MB at V = 49152)

LogitSink = Callable[[int, Tensor], None]
"""Receives ``(index of the first row in logit_rows, float32 logits [S, V])``."""

StepResults = tuple[
    dict[str, int | list[int]],
    dict[str, TokenLogprobs | list[TokenLogprobs]],
    dict[str, list[TokenLogprobs]],
]
"""What ``ModelRunner.execute`` returns: sampled tokens, their logprobs, prompt logprobs."""


@dataclass
class Batch:
    """One step's model inputs: ``step`` and its tensors on the model's device. On rank
    0, ``sample_reqs[i]`` samples from row ``step.logit_rows[i]``, and the logit rows
    after those score ``prompt_spans``, in order; workers leave both empty. A request
    with ``k`` drafts has ``k + 1`` consecutive sampling rows (``DraftRow``s);
    ``sample_counts`` gives each sampling request's number of rows, in order."""

    step: StepInput
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    sample_reqs: list[SampleRow] = field(default_factory=list)
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    sample_counts: list[tuple[Request, int]] = field(default_factory=list)
    images: ImageRows | None = None  # rank 0 without parallelism: see engine.image_rows
    lora: LoraRows | None = None  # the rows with a LoRA adapter (engine.adapters), if any


def batch_from_step(
    step: StepInput,
    device: torch.device,
    sample_reqs: list[SampleRow] | None = None,
    prompt_spans: list[PromptSpan] | None = None,
    sample_counts: list[tuple[Request, int]] | None = None,
) -> Batch:
    """The tensors of ``step`` on ``device`` (the byte arrays are wrapped, not copied, on
    the host)."""

    def ints(buf: bytearray, dtype: torch.dtype) -> Tensor:
        return torch.frombuffer(buf, dtype=dtype).to(device)

    b = len(step.seq_lens)
    meta = AttentionMetadata(
        slot_mapping=ints(step.slot_mapping, torch.long),
        block_tables=ints(step.block_tables, torch.int32).view(b, -1),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(step.query_start, dtype=torch.int32, device=device),
        seq_lens_list=step.seq_lens,
        query_start_list=step.query_start,
        num_decodes=step.num_decodes,
        max_seq_len=max(step.seq_lens),
        state_slots=step.state_slots,
        state_loads=step.state_loads,
        state_saves=step.state_saves,
    )
    return Batch(
        step,
        ints(step.input_ids, torch.long),
        ints(step.positions, torch.long),
        meta,
        sample_reqs or [],
        prompt_spans or [],
        sample_counts or [],
    )


@dataclass
class InFlight:
    """A batch ``ModelRunner.submit`` started and ``complete`` finishes: its grammar mask
    (taken at submission), and its logits when they are already here (no pipeline:
    ``staged`` False; with one, the last stage samples and ``complete`` receives what it
    sampled)."""

    batch: Batch
    scorer: PromptScorer | None
    mask: GrammarMask | None
    logits: Tensor | None
    staged: bool


@dataclass(frozen=True)
class PipelineLinks:
    """This rank's place in the pipeline: stage ``stage`` of ``num_stages``, tensor-parallel
    rank ``tp_rank`` of the stage's ``tp_size`` (global rank ``stage * tp_size +
    tp_rank``), and the group of all ranks the stages send to each other on. Each rank
    sends its (all-reduced, so full) residual stream to the same TP rank of the next
    stage; the last stage's TP rank 0 holds the gathered logits, samples the sampling rows
    and sends rank 0 the tokens, and the logits of the prompt rows scored."""

    group: TensorParallelGroup
    stage: int
    num_stages: int
    tp_rank: int = 0
    tp_size: int = 1

    def rank_of(self, stage: int) -> int:
        """This rank's counterpart (same TP rank) in ``stage``."""
        return stage * self.tp_size + self.tp_rank

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


class ModelRunner:
    """Runs the model on one rank. Rank 0 (``sampler`` set) also lays out and samples
    each step; ``broadcast``, when set, hands each step's ``StepInput`` to the other
    tensor-parallel ranks before the forward pass (whose collectives they join)."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        sampler: Sampler | None,
        broadcast: Callable[[StepInput], None] | None = None,
        kv_dtype: torch.dtype | None = None,
        num_state_slots: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.broadcast = broadcast
        self.device = model.norm.device
        # the cache's own dtype (--kv-cache-dtype; default: the model's): attention
        # converts on the store and reads it back in float32
        dtype = kv_dtype or model.norm.dtype
        # per layer held (all, without pipeline parallelism): its K/V blocks in its
        # layer's shape (an attention backend may keep K in a layout of its own, the CPU
        # kernel's), the very tensors of the layer whose cache it reads (Gemma 4's
        # KV-shared layers: no blocks of their own; ``LlamaModel.kv_cache_shapes``: a
        # latent-attention layer's one tensor), or for a hybrid model's recurrent
        # layer its states, one row per slot and saved state (``num_state_slots`` rows,
        # ``engine.state_cache``; float32 always: a recurrence accumulates every token it
        # has seen)
        self.num_state_slots = num_state_slots
        self.kv_caches: list[tuple[Tensor, ...]] = []
        for i in range(len(model.layers)):
            states = model.state_shapes(i)
            if states is not None:
                self.kv_caches.append(
                    tuple(
                        torch.zeros((num_state_slots, *s), dtype=torch.float32, device=self.device)
                        for s in states
                    )
                )
                continue
            source, _, _ = model.kv_layout(i)
            if source != i:
                self.kv_caches.append(self.kv_caches[source])
                continue
            self.kv_caches.append(
                tuple(
                    torch.zeros(shape, dtype=dtype, device=self.device)
                    for shape in model.kv_cache_shapes(i, num_blocks, block_size)
                )
            )
        model.decode_planner = decode_plan.plan
        model.choose_decode_loop()  # the fused CPU path: native decode steps or not, said
        self.pp: PipelineLinks | None = None  # set on each rank with pipeline parallelism
        self.num_sampled_by_last_stage = 0  # rank 0: batches the last stage sampled
        # rank 0 with pipeline parallelism: what rows carry (the engine sets its budget)
        self.stage_feed = StageFeed(stage_budget(0))
        # the last pipeline stage's TP rank 0: samples every row (set by the worker)
        self.stage_sampler: StageSampler | None = None
        self.decode_graphs: DecodeGraphs | None = None  # CUDA only, see capture_decode_graphs
        self.grammar: GrammarManager | None = None  # rank 0, set by the engine
        # attention rows a step may have when short chunks of generated tokens are laid
        # out as decode rows (see prepare); 0: never. Set by the engine to max_num_seqs.
        self.max_rows = 0
        # a vision-language model's image side and its encoder outputs (set by the
        # engine; one process only: images are refused with tensor/pipeline parallelism)
        self.vision: VisionModel | None = None
        self.encoder_cache: EncoderCache[Tensor] = EncoderCache(0)
        self.adapters: AdapterRegistry | None = None  # LoRA adapters (set by the engine)
        # plain decode steps laid out in place (engine.decode_batch; host tensors only)
        self.decode_batch = (
            DecodeBatch(block_size, self.device) if self.device.type == "cpu" else None
        )

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture CUDA graphs for decode-only steps (see ``cuda_graphs``)."""
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.block_size, max_num_seqs, max_model_len
        )
        graphs.capture()
        self.decode_graphs = graphs

    def _decode_chunks(self, sched: SchedulerOutput) -> set[str]:
        """Requests whose chunk of several *generated* tokens (a sampled token and the
        ones grammar fast-forward appended) is laid out as one decode row per token: row
        ``i`` attends to the cache up to its own position, which the step's K/V store has
        already written, so it is causal attention, computed by the batched decode
        kernel (as step-by-step decoding would compute those tokens) instead of a
        per-sequence prefill. Total rows stay within ``max_rows``."""
        spare = self.max_rows - len(sched.scheduled)
        chosen: set[str] = set()
        for req, n in sched.scheduled:
            if 1 < n <= spare + 1 and req.num_computed_tokens >= req.prompt_len:
                chosen.add(req.request_id)
                spare -= n - 1
        return chosen

    def _lora_spans(self, ordered: Sequence[tuple[Request, int]]) -> list[tuple[int, int]]:
        """``(adapter uid or 0, rows)`` per request in batch order; empty where no row
        has an adapter (or the engine has no LoRA)."""
        if self.adapters is None or not any(r.lora_uid for r, _ in ordered):
            return []
        return [(r.lora_uid, n) for r, n in ordered]

    def prepare(self, sched: SchedulerOutput) -> Batch:
        """The flat batch of ``sched``: decode rows (one new token each; see
        ``_decode_chunks``) first, so attention can batch them, then prefill chunks.
        Logit rows: one per sampling request (``1 + k`` for one with ``k`` drafts: its
        newest token and the drafts are one chunk, verified together), then one per
        prompt position to score."""
        if (
            self.decode_batch is not None
            and self.pp is None
            and not self.num_state_slots
            and self.decode_batch.plain(sched.scheduled)
        ):
            lora = self._lora_spans(sched.scheduled)
            loras = self.adapters.loads(lora) if self.adapters and lora else None
            step, meta, ids, pos = self.decode_batch.step(sched.scheduled, lora, loras)
            reqs: list[SampleRow] = [req for req, _ in sched.scheduled]
            counts = [(req, 1) for req, _ in sched.scheduled]
            batch = Batch(step, ids, pos, meta, reqs, [], counts)
            if lora and self.adapters is not None:
                batch.lora = self.adapters.rows(lora)
            return batch
        as_decodes = self._decode_chunks(sched) if self.max_rows else set()
        ordered = sorted(
            sched.scheduled, key=lambda rn: rn[1] != 1 and rn[0].request_id not in as_decodes
        )
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[SampleRow] = []
        sample_counts: list[tuple[Request, int]] = []
        prompt_rows: list[int] = []
        spans: list[PromptSpan] = []
        state_slots: list[int] = []
        state_loads: list[tuple[int, int]] = []  # (saved row, slot)
        state_saves: list[tuple[int, int, int]] = []  # (sequence, rows in, saved row)
        chunks: list[Chunk] = []  # prefill chunks holding image positions
        spatial: list[Spatial] = []  # M-RoPE chunks over image tokens: see mrope_rows
        for req, n in ordered:
            start = req.num_computed_tokens
            end = start + n
            if req.images and start < req.prompt_len:
                chunks.append(Chunk(req, start, n, query_start[-1], len(seq_lens)))
            blocks = req.block_ids
            input_ids += req.token_ids[start:end]
            drafts = req.draft_token_ids
            input_ids += drafts  # (a drafted chunk's slice ends at the last known token)
            if req.mrope is None:
                positions += range(start, end)
            else:  # 3-D rotary positions (engine.mrope): h and w only where images are
                if (hw := req.mrope.spatial(start, end)) is not None:
                    spatial.append((len(positions), hw))
                positions += req.mrope.flat(start, end)
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            if req.request_id in as_decodes:  # row per token; ends within the sequence
                seq_lens += range(start + 1, end + 1)
                query_start += range(query_start[-1] + 1, query_start[-1] + n + 1)
                tables += [blocks] * n
            else:
                seq_lens.append(end)
                query_start.append(query_start[-1] + n)
                tables.append(blocks)
            if self.num_state_slots:  # (hybrid models lay out no decode chunks)
                state_slots.append(req.state_slot)
                if req.state_load >= 0:
                    state_loads.append((req.state_load, req.state_slot))
                if req.state_save is not None:
                    at, row = req.state_save
                    state_saves.append((len(seq_lens) - 1, at - start, row))
            if req.samples_after(n):
                last = query_start[-1] - 1
                k = len(drafts)
                sample_rows += range(last - k, last + 1)
                sample_reqs += [DraftRow(req, drafts[:j]) for j in range(k)] if k else []
                sample_reqs.append(DraftRow(req, drafts) if k else req)
                sample_counts.append((req, k + 1))
            first, count = req.prompt_logprob_span(n)
            if count:  # the rows of positions first .. first + count - 1
                row0 = query_start[-2] + first - start
                prompt_rows += range(row0, row0 + count)
                spans.append(PromptSpan(req, first, count))

        lora_spans = self._lora_spans(ordered)
        width = max(len(t) for t in tables)
        flat_tables = array("i")
        for t in tables:
            flat_tables.extend(t)
            flat_tables.extend([0] * (width - len(t)))
        step = StepInput(
            input_ids=bytearray(array("q", input_ids)),
            positions=bytearray(array("q", positions)),
            slot_mapping=bytearray(array("q", slots)),
            block_tables=bytearray(flat_tables),
            seq_lens=seq_lens,
            query_start=query_start,
            num_decodes=sum(n if n == 1 or r.request_id in as_decodes else 0 for r, n in ordered),
            logit_rows=sample_rows + prompt_rows,
            state_slots=state_slots,
            state_loads=state_loads,
            state_saves=state_saves,
            loras=self.adapters.loads(lora_spans) if self.adapters and lora_spans else [],
            lora_spans=lora_spans,
        )
        batch = batch_from_step(step, self.device, sample_reqs, spans, sample_counts)
        if lora_spans:  # each request's rows are n consecutive ones
            assert self.adapters is not None
            batch.lora = self.adapters.rows(lora_spans)
        if spatial:
            batch.positions = mrope_rows(batch.positions, spatial)
        if chunks and self.vision is not None:
            cache = self.encoder_cache
            batch.images = image_rows(chunks, len(input_ids), self.vision, cache, self.device)
            if batch.images is not None and batch.images.ahead is not None:
                batch.meta = replace(
                    batch.meta, ahead=batch.images.ahead, ahead_seqs=batch.images.ahead_seqs
                )
        return batch

    def run(
        self,
        batch: Batch,
        sink: LogitSink | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> Tensor | None:
        """Hand ``batch`` to the other ranks (if any), run the model over it here and
        return the float32 logits of its ``logit_rows`` (``[N, V]`` on rank 0), or None
        when there are none. With ``sink``, each slice of logits goes there instead
        (in order) and None is returned. ``between_layers``: see ``LlamaModel.forward``;
        never called with tensor parallelism (every rank must run every layer)."""
        # with pipeline parallelism rank 0 samples through submit/complete; here it can
        # only run steps without logit rows (nothing would take the last stage's answer)
        assert self.pp is None or not batch.step.logit_rows
        if self.broadcast is not None:
            self.broadcast(batch.step)
            between_layers = None
        return self.forward(batch, sink, between_layers)

    def forward(
        self,
        batch: Batch,
        sink: LogitSink | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> Tensor | None:
        """The forward pass of ``batch`` on this rank, as ``run`` (on a worker the logits
        are its vocabulary slice, already gathered to rank 0)."""
        if self.pp is not None:
            self._forward_stage(self.pp, batch)  # (its answer goes to rank 0, not here)
            return None
        with torch.inference_mode():
            hidden = None
            if (
                self.decode_graphs is not None
                and batch.images is None
                and batch.lora is None
                and batch.positions.dim() == 1
            ):
                hidden = self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is None:
                # with images: the embeddings with the encoder rows in place, fed to the
                # first layer as its residual stream (forward's ``hidden``)
                embeds = (
                    batch.images.embed(self.model.embed(batch.input_ids))
                    if batch.images is not None
                    else None
                )
                deep = batch.images.deepstack if batch.images is not None else None
                try:
                    with active(self.model, batch.lora), injected(self.model, deep):
                        hidden = self.model(
                            batch.input_ids,
                            batch.positions,
                            self.kv_caches,
                            batch.meta,
                            between_layers,
                            embeds,
                        )
                finally:
                    self.encoder_cache.unpin_all()  # the step's images may go from now on
            rows = batch.step.logit_rows
            parts: list[Tensor] = []
            if 0 < len(rows) <= LOGIT_SLICE and rows == list(range(len(rows))):
                # a decode step's rows: the leading ones, a view (no index tensor, no
                # copy), or all of them (no op at all)
                head = hidden if hidden.shape[0] == len(rows) else hidden[: len(rows)]
                logits = self.model.compute_logits(head)
                if sink is None:
                    return logits
                sink(0, logits)
                return None
            for a in range(0, len(rows), LOGIT_SLICE):  # the same slices on every rank
                logits = self.model.compute_logits(hidden[rows[a : a + LOGIT_SLICE]])
                if sink is None:
                    parts.append(logits)
                else:
                    sink(a, logits)
            if not parts:
                return None
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _forward_stage(self, pp: PipelineLinks, batch: Batch) -> None:
        """One pipeline stage's share of ``forward`` on a worker: receive the residual
        stream from the stage before (``[T, hidden]``, one message), run this stage's
        layers, send it on; the last stage samples (``_stage_logits``)."""
        hidden = self._stage_layers(pp, batch)
        if pp.last:
            self._stage_logits(pp, batch, hidden)

    def _stage_layers(self, pp: PipelineLinks, batch: Batch) -> Tensor:
        """Receive, run this stage's layers, send on (not waiting for the send to be
        taken: rank 0 may start the next batch meanwhile). Returns the hidden states."""
        model = self.model
        with torch.inference_mode():
            hidden_in = None
            if pp.stage > 0:
                hidden_in = torch.empty(
                    (len(batch.input_ids), model.cfg.hidden_size),
                    dtype=model.norm.dtype,
                    device=self.device,
                )
                pp.group.recv(hidden_in, pp.rank_of(pp.stage - 1))
            hidden = model(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta, None, hidden_in
            )
            if not pp.last:
                pp.group.send_async(hidden, pp.rank_of(pp.stage + 1))
            return hidden

    def _stage_logits(self, pp: PipelineLinks, batch: Batch, hidden: Tensor) -> None:
        """The last stage's end of a step: the logits slices of ``hidden`` (its own
        layers' output; every TP rank computes them, the stage's TP rank 0 gets them
        gathered). The sampling rows (the first ``N`` logit rows, one per
        ``step.last_stage_rows``) are sampled once the slice holding the last of them is
        here, and ``stage_sampling.pack`` of the result goes to rank 0; each slice's
        prompt rows after them go to rank 0 as logits. (Rank 0's side: ``_receive``.)"""
        model, step = self.model, batch.step
        rows, stage_rows = step.logit_rows, step.last_stage_rows or []
        n = 0 if step.rank0_samples else len(stage_rows)  # else every row goes as logits
        sampler = self.stage_sampler if pp.tp_rank == 0 else None
        if sampler is not None:
            sampler.release(step.released)
            sampler.ingest(stage_rows)
        with torch.inference_mode():
            parts: list[Tensor] = []
            for a in range(0, len(rows), LOGIT_SLICE):
                logits = model.compute_logits(hidden[rows[a : a + LOGIT_SLICE]])
                if pp.tp_rank != 0:
                    continue
                assert sampler is not None, "the last stage's TP rank 0 samples"
                end = a + logits.shape[0]
                if a < n:
                    parts.append(logits[: n - a])
                if a < n <= end:  # the slice with the last sampling row
                    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
                    msg = sampler.sample(whole.cpu(), stage_rows)  # [M] float64, CPU
                    pp.group.send(msg.to(self.device), 0)  # (NCCL sends device tensors)
                if end > n:  # prompt rows to score
                    pp.group.send(logits[max(0, n - a) :], 0)

    def _receive(
        self, pp: PipelineLinks, batch: Batch, sink: LogitSink | None
    ) -> tuple[list[int], list[TokenLogprobs | None]] | None:
        """Rank 0's end of ``_stage_logits``, message for message: the sampled tokens and
        logprobs of the sampling rows (None if there are none), and the prompt rows'
        logits, which go to ``sink`` as ``(index in logit_rows, [S, V])``; with
        ``rank0_samples``, every row's logits go there."""
        step, reqs = batch.step, batch.sample_reqs
        rows = step.logit_rows
        n = 0 if step.rank0_samples else len(step.last_stage_rows or ())
        last = (pp.num_stages - 1) * pp.tp_size
        sampled = None
        with torch.inference_mode():
            for a in range(0, len(rows), LOGIT_SLICE):
                end = min(a + LOGIT_SLICE, len(rows))
                if a < n <= end:
                    msg = torch.empty(packed_size(reqs), dtype=torch.float64, device=self.device)
                    pp.group.recv(msg, last)
                    sampled = unpack(msg.cpu(), reqs)
                if end > n:
                    logits = torch.empty(
                        (end - max(a, n), self.model.cfg.vocab_size), device=self.device
                    )
                    pp.group.recv(logits, last)
                    assert sink is not None, "prompt rows come with a scorer"
                    sink(max(a, n), logits)
        return sampled

    def execute(
        self, sched: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> StepResults:
        """Run the model over ``sched``, sample for the requests that reach the end of
        their known tokens and score the prompt positions asked for. Returns
        ``{request_id: token}``, the requested logprobs and the prompt logprobs (of each
        request's ``prompt_logprob_span``); for a request with drafts, the list of tokens
        its rows emit (``speculative.accept``) and a list of their logprobs.
        ``between_layers`` may raise to cut the step short (see
        ``LlamaModel.forward``); nothing is sampled then."""
        return self.complete(self.submit(sched, between_layers))

    def submit(
        self, sched: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> InFlight:
        """The first half of ``execute``: lay out ``sched`` and run it. With pipeline
        parallelism this runs stage 0 only and returns once its hidden states are on
        their way, so rank 0 can submit the next batch while the later stages work on
        this one; ``complete`` takes the logits from the last stage (in submission
        order) and samples."""
        assert self.sampler is not None, "only rank 0 samples"
        batch = self.prepare(sched)
        # the constrained rows' bitmask is computed while the model runs
        pending = self.grammar.start_fill(batch.sample_reqs) if self.grammar is not None else None
        scorer = PromptScorer(batch.prompt_spans) if batch.prompt_spans else None
        pp = self.pp
        try:
            if pp is not None:  # rank 0 is stage 0; the sampled tokens come later (complete)
                # the last stage applies the mask: it goes out with the step
                mask = pending.result() if pending is not None else None
                pending = None
                rows, released, whole = self.stage_feed.rows(batch.sample_reqs, mask)
                batch.step = msgspec.structs.replace(
                    batch.step,
                    last_stage_rows=rows or None,
                    released=released,
                    rank0_samples=not whole,
                )
                if self.broadcast is not None:
                    self.broadcast(batch.step)
                self._stage_layers(pp, batch)
                return InFlight(batch, scorer, mask, None, True)
            else:
                logits = (
                    self.run(batch, None, between_layers)
                    if scorer is None
                    else self._run_scoring(
                        batch, scorer, lambda s: self.run(batch, s, between_layers)
                    )
                )
        except BaseException:
            if pending is not None:  # its matchers may be freed next: let it finish first
                wait([pending])
            raise
        # taken now: an abort before ``complete`` may free a matcher
        mask = pending.result() if pending is not None else None
        return InFlight(batch, scorer, mask, logits, False)

    def complete(self, job: InFlight) -> StepResults:
        """The second half of ``execute``: the logits (from the last stage, with pipeline
        parallelism), sampling and the prompt scores."""
        assert self.sampler is not None, "only rank 0 samples"
        batch, scorer, mask, logits = job.batch, job.scorer, job.mask, job.logits
        pp = self.pp
        staged = None
        if job.staged and pp is not None and batch.step.rank0_samples:  # logits come
            logits = self._run_scoring(batch, scorer, lambda s: self._receive(pp, batch, s))
        elif job.staged and pp is not None:
            staged = self._receive(
                pp, batch, (lambda _a, x: scorer.add(x)) if scorer is not None else None
            )
        reqs = batch.sample_reqs
        sampled: dict[str, int | list[int]] = {}
        lps: dict[str, TokenLogprobs | list[TokenLogprobs]] = {}
        if logits is not None or staged is not None:
            if staged is not None:  # sampled on the last stage
                self.num_sampled_by_last_stage += 1
                tokens, logprobs = staged
            else:
                assert logits is not None
                with torch.inference_mode():
                    host = logits if logits.is_cpu else logits.cpu()
                    tokens, logprobs = self.sampler(host, reqs, mask)
            if mask is not None and self.grammar is not None:
                self.grammar.record(mask)
            i = 0
            for req, rows in batch.sample_counts:
                rid, lp = req.request_id, logprobs[i]
                if rows == 1:
                    sampled[rid] = tokens[i]
                    if lp is not None:
                        lps[rid] = lp
                else:
                    emitted = accept(tokens[i : i + rows], req.draft_token_ids)
                    sampled[rid] = emitted
                    if lp is not None:
                        lps[rid] = [x for x in logprobs[i : i + len(emitted)] if x is not None]
                i += rows
        return sampled, lps, scorer.results() if scorer is not None else {}

    def _run_scoring(
        self,
        batch: Batch,
        scorer: PromptScorer | None,
        run: Callable[[LogitSink], object],
    ) -> Tensor | None:
        """``run`` (a forward pass, or the receipt of the last stage's logits) for a batch
        with prompt rows: those go to ``scorer`` slice by slice; returns the logits
        ``[N, V]`` of the N sampling rows (None if N is 0)."""
        n = len(batch.sample_reqs)
        parts: list[Tensor] = []

        def sink(a: int, logits: Tensor) -> None:  # logits: [S, V], rows a .. a+S-1
            if a < n:
                parts.append(logits[: n - a])
            if a + logits.shape[0] > n:
                assert scorer is not None, "prompt rows come with a scorer"
                scorer.add(logits[max(0, n - a) :])

        run(sink)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)
