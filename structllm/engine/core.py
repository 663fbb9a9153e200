"""The engine loop's body: drain inputs, schedule, execute, emit one ``OutputBatch``.

``EngineCore`` is synchronous and owns the model, the KV cache and the scheduler. The
offline ``LLM`` calls it directly; the engine process drives it from its rings.

With ``tensor_parallel_size`` N > 1 this process is rank 0: it keeps the scheduler, the
KV cache manager and the sampler, holds its own shard of the model and of the KV cache,
and owns the N-1 worker processes (``worker_pool.WorkerPool``); ``close`` stops them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from itertools import chain
from pathlib import Path

import msgspec
import torch

from structllm.config import EngineConfig, SpeculativeConfig
from structllm.engine.adapters import AdapterRegistry
from structllm.engine.device import (
    drop_library_pages,
    kv_budget,
    load_rank_model,
    local_num_blocks,
    release_free_heap,
    resolve_device,
    setup_device,
    worker_device,
)
from structllm.engine.encoder_cache import EncoderCache
from structllm.engine.grammar import GrammarManager
from structllm.engine.held import Held
from structllm.engine.kv_cache import KVCacheManager
from structllm.engine.mrope import MRopePositions
from structllm.engine.null import NullRunner
from structllm.engine.pooling import Pooler, PoolingRunner, make_scorer
from structllm.engine.request import Request
from structllm.engine.runner import InFlight, ModelRunner, PipelineLinks, batch_from_step
from structllm.engine.sampler import Sampler
from structllm.engine.scheduler import Scheduler, SchedulerOutput
from structllm.engine.speculative import Drafter, SpecStats
from structllm.engine.stage_sampling import StageFeed, stage_budget
from structllm.engine.state_cache import StateCacheManager
from structllm.engine.step_budget import DEFAULT_TOKEN_BUDGET, PROBE_TOKENS, auto_token_budget
from structllm.engine.worker_pool import WorkerPool, ring_capacity_for
from structllm.kernels.cpu_ext import best_isa
from structllm.kernels.packed import ROW_KERNEL_ROWS
from structllm.model.collectives import TensorParallelGroup
from structllm.model.files import ModelFiles, with_hf_overrides
from structllm.model.formats import resolve_format, resolve_kv_cache_dtype, resolve_lora_dtype
from structllm.model.llama import LlamaModel
from structllm.model.loader import prepare_model
from structllm.model.lora import slot_bytes
from structllm.model.pooler_config import PoolerSpec, read_pooler, resolve_runner
from structllm.model.sharding import ShardPlan, plan_shards
from structllm.model.stages import stage_layers
from structllm.model.vision import VisionModel, load_vision, vision_config
from structllm.protocol import (
    Abort,
    AddRequest,
    EngineStats,
    GetStats,
    ImageInput,
    LoraRef,
    OutputBatch,
    PoolerInfo,
    SamplingParams,
    Shutdown,
    ToEngine,
    TokenDelta,
)
from structllm.structured import Matcher
from structllm.trace import Tracer, now_us

log = logging.getLogger("structllm.engine")

COMPILE_WAIT_S = 0.005  # an otherwise idle step waits this long for a grammar to compile
# What a decode step of r rows (index r - 1; one request's newest token and drafts, or
# several requests') costs against a 1-row step, on CPU with GGUF blocks: the drafter
# picks each request's draft length from it (``speculative.best_draft_length``).
# bench/speculative.py's step costs on the default model, 400-token context, AVX-512
# (2026-12-03, eighth session, with the 16-row kernels of AVX-512 VNNI builds, quiet,
# three rounds: 2 rows 1.14-1.21x, 3 rows 1.28-1.45x, 4 rows 1.44-1.61x, 5 rows
# 1.43-1.58x, 6 rows 1.78-1.98x, 7 rows 1.92-2.21x, 8 rows 2.13-2.15x; before them,
# quiet: 4 rows 1.56-1.62x, 5 rows 1.80-1.99x, 8 rows 2.49-2.59x, the old table's
# 1.6 / 2.0 / 2.6; an AVX-512 CPU without VNNI has no 16-row kernels and still pays
# those, so there drafts run a little longer than pays). Up to ROW_KERNEL_ROWS (8; 5 on
# the AVX2 build)
# the row kernel reads each block once for every row; past it the blocked GEMMs round
# the rows up to 16 (a 5-row step cost ~3x), or on AVX-512 VNNI the row kernel runs a
# second pass for Q4_0/Q4_1/Q8_0 (up to 16 rows), so drafts stop at the table's end. So one request
# drafts up to 7 while nearly all are accepted, 2-3 at ~70%; two running decodes need
# ~70% for any draft to pay, four or more ~80% with long drafts, eight none.
# By the ISA the block kernels run on (``cpu_ext.best_isa``). The AVX2 build's row
# kernel serves 1-5 rows (6-8 go to its GEMM: 6 rows ~3x), and each row costs more:
# bench/speculative.py --workloads cost with STRUCTLLM_CPU_ISA=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 (2026-12-03, two runs, load 6-8: 2 rows 1.43x, 3 rows
# 1.72-1.79x, 4 rows 2.07-2.18x, 5 rows 2.12-2.69x, 6 rows 2.96-3.18x; ninth session,
# load 0.6-1.6, with the int16-summing nibble kernel: 2 rows 1.16-1.31x, 3 rows
# 1.48-1.55x, 4 rows 1.90-1.91x, 5 rows 2.08-2.15x, 6 rows 2.63-2.78x: the table below,
# which drafted as the loaded one did: grounded c=1 decode 1.74-1.80x either way). So
# on AVX2 a lone request drafts at most 4, one draft pays from ~30% accepted.
DRAFT_STEP_COSTS = {
    "avx512": (1.0, 1.2, 1.4, 1.55, 1.7, 1.9, 2.1, 2.2)[:ROW_KERNEL_ROWS],
    "avx2": (1.0, 1.3, 1.55, 1.9, 2.15),
}
DRAFT_STEP_COST = DRAFT_STEP_COSTS[best_isa() or "avx2"]
DRAFT_STEP_ROWS = len(DRAFT_STEP_COST)
# Without a speculative_config: n-gram drafts with the adaptive length on CPU with GGUF
# blocks (their kernels are batch-invariant, so outputs do not change), off elsewhere.
# bench/speculative.py at the shapes (2026-12-03, seventh session, after the
# 5-token match gate): open chat c=1 1.07-1.11x tok/s with a per-token ITL p99
# 0.91-0.96x (quiet) and 1.03x (loaded) plain decoding's, 1.00x on the AVX2 build; c=8
# and 16 draft nothing (1.01-1.03x, noise); input-grounded c=1 1.51-1.62x tok/s, decode
# 1.84-2.00x; c=4 drafts almost nothing (beside 3 other decodes a draft pays only at
# ~85% acceptance, and a step with a prompt chunk has no rows left under
# DRAFT_STEP_ROWS): 0.94-1.12x over four runs, noise. Eighth session, with the 16-row
# kernels and their table: input-grounded c=1 decode 2.07-2.25x, c=4 1.06-1.11x tok/s;
# open chat c=1 1.08-1.10x with ITL p99 0.98-1.01x, c=8 1.03x and c=16 1.00x
# (off-on-on-off rounds; a handful of one-draft chunks at 7 running decodes).
SPECULATIVE_BY_DEFAULT = True
# A hybrid model's saved recurrent states (prefix caching, engine.state_cache) per
# running slot, within a quarter of the cache budget: each prefill chunk saves at most
# one, so this keeps the last few prompts' resumable prefixes per concurrent request.
SAVED_PER_SLOT = 2
# what a pooling request runs with: its prompt only (engine.pooling)
PROMPT_ONLY = SamplingParams(temperature=0.0, max_tokens=0)


class StepCutShort(Exception):
    """Raised between layers when the running step is not worth finishing (``Held``)."""


class EngineCore:
    def __init__(self, config: EngineConfig, files: ModelFiles | None = None) -> None:
        self.config = config
        self.tracer = Tracer(config.trace, "structllm engine")
        self.files = with_hf_overrides(files or prepare_model(config.model), config.hf_overrides)
        mcfg = self.files.config
        if mcfg.hybrid and (config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1):
            raise ValueError(
                f"{mcfg.architecture} is a hybrid model (recurrent layers): tensor and "
                "pipeline parallelism are not supported for it"
            )
        if not mcfg.uniform_layers and (
            config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1
        ):
            raise ValueError(
                f"{mcfg.architecture} has layers of several K/V shapes or layers reading "
                "another layer's K/V: tensor and pipeline parallelism are not supported for it"
            )
        if config.enable_lora and config.pipeline_parallel_size > 1:
            raise ValueError("LoRA adapters do not run with pipeline parallelism")
        if mcfg.kv_lora_rank and (
            config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1
        ):
            raise ValueError(
                f"{mcfg.architecture} (multi-head latent attention) runs in one process: "
                "tensor and pipeline parallelism are not supported for it"
            )
        # The null model runs no forward pass, so there is nothing to split.
        world = 1 if config.null_model else config.tensor_parallel_size
        plan = (
            plan_shards(mcfg, world)[0] if world > 1 else None
        )  # a model that cannot be split fails here
        # pipeline stages (rank 0 is stage 0): as early, a model with too few layers
        self.stages = 1 if config.null_model else config.pipeline_parallel_size
        self.layers = stage_layers(mcfg.num_layers, self.stages, 0) if self.stages > 1 else None
        ranks = world * self.stages
        self.device = resolve_device(config) if ranks == 1 else worker_device(config, 0)
        self.dtype = setup_device(config, self.device, ranks // config.nnodes)  # this host's
        if config.enable_lora and world > 1 and self.device.type == "cuda":
            raise ValueError(
                "LoRA adapters with tensor parallelism run on the CPU only (the CUDA slots "
                "of model.lora_slots hold whole adapters)"
            )
        fmt = None
        if (
            not config.null_model
        ):  # a bad --dtype/--quantization combination fails here, before any worker
            fmt = self.weight_format = resolve_format(config, self.device, self.files, world)
        self.kv_dtype = resolve_kv_cache_dtype(
            config, self.device, fmt
        )  # as is a bad --kv-cache-dtype
        self.pooler_spec = self._pooler_spec()
        self.workers: WorkerPool | None = None
        try:
            self._start(plan)
        except BaseException:
            self.close()
            raise
        self._pending: list[TokenDelta] = []  # refusals and aborts, sent with the next batch
        self._most_urgent: int | None = None  # the smallest priority any request came with
        self._traced_blocks: dict[
            str, int
        ] = {}  # request id -> KV blocks it held at the last trace
        self.num_steps = 0  # model steps run (a step with nothing scheduled is not one)
        self.num_steps_cut = 0  # steps cut short: all aborted, or an urgent arrival
        self.num_aborted = 0  # live requests aborted (unknown or finished ids not counted)
        # constrained requests whose matcher is being built, in arrival order
        self._compiling: dict[str, tuple[Request, Future[Matcher | str]]] = {}
        # pipeline parallelism: batches submitted and not yet completed, oldest first,
        # and the ids of their requests (see _pipelined_step)
        self.pipeline_depth = self.stages if isinstance(self.runner, ModelRunner) else 1
        self._in_flight: deque[tuple[SchedulerOutput, InFlight, int]] = deque()
        self._busy: set[str] = set()
        self.max_in_flight = 0  # the most batches in flight at once so far (tests, benchmarks)

    def _pooler_spec(self) -> PoolerSpec | None:
        """The pooling runner's pooler (``--runner``; ``auto``: by the checkpoint), said
        at start-up with the runner; None: the generate runner."""
        config = self.config
        runner = resolve_runner(config.runner, self.files, config.hf_overrides)
        if runner == "generate":
            if self.files.config.bidirectional:
                raise ValueError(
                    f"{self.files.name} attends both ways (an embedding model): it cannot "
                    "generate; run it with --runner pooling"
                )
            sys.stderr.write("structllm: runner: generate\n")
            return None
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            raise ValueError(
                "the pooling runner runs in one process: no tensor or pipeline parallelism"
            )
        if config.null_model:
            raise ValueError("the null model pools nothing: it needs the generate runner")
        if self.files.config.hybrid:
            raise ValueError(
                f"the pooling runner does not run {self.files.config.architecture}, a hybrid model"
            )
        spec = read_pooler(self.files, config.pooler_config, config.hf_overrides)
        sys.stderr.write(
            f"structllm: runner: pooling ({spec.describe(self.files.config.hidden_size)})\n"
        )
        if self.files.config.bidirectional:
            sys.stderr.write(
                "structllm: attention both ways: each input runs whole in one step "
                "(no chunked prefill, no prefix cache)\n"
            )
        return spec

    @property
    def pooler_info(self) -> PoolerInfo | None:
        """The pooling runner's model as a front end sees it (None: generate)."""
        spec = self.pooler_spec
        return spec.info(self.files.config.hidden_size) if spec is not None else None

    def _start(self, plan: ShardPlan | None) -> None:
        group = self._load(plan)
        self._size_kv_cache(plan, group)
        self.eos_token_ids = self.files.generation_eos_ids
        # every layer windowed or chunked: blocks can go (a query's chunk starts at most
        # chunk - 1 keys back, so a chunk frees what a window of its size would)
        cfg = self.files.config
        spans = [cfg.window(i) or cfg.chunk(i) for i in range(cfg.num_layers)]
        self.hybrid = cfg.hybrid and self.model is not None
        # CLS and MEAN pooling need every prompt row computed, and a bidirectional
        # model's K/V depend on the tokens after them: no cached blocks
        pooled_rows = self.pooler_spec is not None and self.pooler_spec.pooling_type != "LAST"
        pooled_rows |= cfg.bidirectional
        self.kv = KVCacheManager(
            self.num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching and not pooled_rows,
            window=max(spans) if min(spans) > 0 else 0,
        )
        self.states = (
            StateCacheManager(self.num_state_slots, self.num_saved_states)
            if self.num_state_slots
            else None
        )
        if self.states is not None:  # a block leaving the prefix cache takes its state
            self.kv.on_evict = self.states.drop
        self.runner: ModelRunner | NullRunner = self._make_runner(plan)
        self.max_num_batched_tokens = self._token_budget()
        self.scheduler = Scheduler(
            self.kv,
            self.config.max_num_seqs,
            self.max_num_batched_tokens,
            self.eos_token_ids,
            self.states,
            self.config.scheduling_policy,
        )
        self.grammar = GrammarManager(
            str(self.files.tokenizer_json),
            self.eos_token_ids,
            self.vocab_size,
            self.config.grammar_fast_forward,
        )
        self.scheduler.grammar = self.grammar
        self.scheduler.whole_prompts = self.files.config.bidirectional
        if isinstance(self.runner, ModelRunner):  # images' encoder work counts (scheduler)
            self.scheduler.encoder_cache = self.runner.encoder_cache
        # causal image attention: a prefill chunk may cut an image's span like text
        self.scheduler.split_spans = self.vision is not None and not self.vision.bidirectional
        spec = self.config.speculative_config
        if self.pooler_spec is not None:  # (nothing is decoded)
            spec = None
        elif spec is None and SPECULATIVE_BY_DEFAULT and self._cpu_blocks and self.hybrid:
            sys.stderr.write(
                "structllm: speculative decoding: off (a hybrid model: a recurrent state "
                "cannot be rolled back past rejected drafts)\n"
            )
        elif spec is None and SPECULATIVE_BY_DEFAULT and self._cpu_blocks:
            spec = SpeculativeConfig()
            sys.stderr.write(
                "structllm: speculative decoding: n-gram drafts, adaptive length (the "
                "default on CPU with GGUF blocks; --speculative-config "
                '\'{"method": "none"}\' turns it off)\n'
            )
        self.set_speculative(spec)
        self.adapters: AdapterRegistry | None = None  # --enable-lora
        self._lora_of: dict[str, int] = {}  # request id -> the adapter load it pins
        if self.config.enable_lora:
            self._enable_lora(plan)
        if isinstance(self.runner, ModelRunner):
            self.runner.grammar = self.grammar
            # (a recurrent state advances one sequence row at a time: no decode chunks)
            self.runner.max_rows = 0 if self.hybrid else self.config.max_num_seqs
        if self.device.type == "cpu":
            release_free_heap()  # what loading and the start-up prefill left free
            drop_library_pages()  # library code only start-up ran (faults back if used)

    def _enable_lora(self, plan: ShardPlan | None) -> None:
        """The adapter registry (``engine.adapters``; with ``plan``, rank 0's slices),
        handed to the runner (a step's rows by adapter) and the scheduler's ``max_loras``."""
        cfg = self.config
        self.adapters = AdapterRegistry(
            self.files.config,
            cfg.max_cpu_loras or cfg.max_loras,
            cfg.max_lora_rank,
            resolve_lora_dtype(cfg, self.device, self.weight_format),
            self.device,
            cfg.max_loras,
            plan,
        )
        self.scheduler.max_loras = cfg.max_loras
        if isinstance(self.runner, ModelRunner):
            self.runner.adapters = self.adapters

    def set_speculative(self, spec: SpeculativeConfig | None) -> None:
        """Turn speculative decoding on with ``spec`` (fresh counters), or off (``None``
        or method ``"none"``), between steps."""
        sched = self.scheduler
        for req in sched.running:  # (none carry drafts between steps)
            req.draft_token_ids = []
        if spec is not None and spec.method == "none":
            spec = None
        if spec is not None and self.hybrid:
            raise ValueError(
                f"speculative decoding is not supported for {self.files.config.architecture}, "
                "a hybrid model: its recurrent state cannot be rolled back past rejected drafts"
            )
        sched.drafter = Drafter(spec) if spec is not None else None
        sched.max_draft_step_tokens = spec.max_step_tokens if spec is not None else None
        # (an explicit max_step_tokens keeps the fixed draft length)
        drafter = sched.drafter
        adaptive = spec is not None and spec.max_step_tokens is None and self._cpu_blocks
        if drafter is not None and adaptive:
            drafter.step_cost = DRAFT_STEP_COST
            sched.max_draft_step_tokens = DRAFT_STEP_ROWS

    @property
    def _cpu_blocks(self) -> bool:
        """The model runs on CPU with GGUF block weights (batch-invariant kernels)."""
        return self.model is not None and self.weight_format.blocks and self.device.type == "cpu"

    @property
    def max_positions(self) -> int:
        """The longest context a request can reach (what the step rings are sized for)."""
        mcfg = self.files.config
        return min(mcfg.context_length, self.config.max_model_len or 1 << 62)

    def _load(self, plan: ShardPlan | None) -> TensorParallelGroup | None:
        """Load the model (with ``plan``: start the workers, join their group and load
        this rank's shard while they load theirs). Returns the group, if any."""
        config, mcfg = self.config, self.files.config
        group: TensorParallelGroup | None = None
        ranks = (plan.world_size if plan is not None else 1) * self.stages
        if ranks > 1:
            capacity = ring_capacity_for(config, self.max_positions, mcfg.vocab_size)
            self.workers = WorkerPool(config, ranks, capacity)
            group = self.workers.connect(self.device)
        self.group = group  # all ranks (pipeline sends, start-up agreement); None alone
        tp_group = group if plan is not None else None  # the layers' all-reduces: TP only
        if plan is not None and self.stages > 1:  # TP inside each stage: a group per stage
            assert self.workers is not None
            tp_group = self.workers.connect_stage(self.device, 0, 0, plan.world_size)
        if config.null_model:
            self.model = None
        else:
            self.model = load_rank_model(
                self.files,
                config,
                self.device,
                self.dtype,
                plan,
                tp_group,
                self.layers,
            )
        if self.workers is not None:
            self.workers.wait_loaded()
        self._load_vision(ranks)
        return group

    def _load_vision(self, ranks: int) -> None:
        """A vision-language checkpoint's tower and projector (``model.vision``), in one
        process only; ``no_images`` says why a model takes no images."""
        self.vision: VisionModel | None = None
        self.no_images = "it has no vision tower"
        if self.model is None:  # (the null model carries images: check_images)
            return
        mmproj = self.config.mmproj
        if vision_config(self.files) is None and mmproj is None:
            return
        if ranks > 1:
            self.no_images = "images are not supported with tensor or pipeline parallelism"
            sys.stderr.write(f"structllm: images: off ({self.no_images})\n")
            return
        if mmproj is not None:  # a GGUF model's tower and projector, from its mmproj file
            from structllm.model.mmproj import load_mmproj

            self.vision = load_mmproj(Path(mmproj), self.files, self.weight_format, self.device)
            return
        self.vision = load_vision(self.files, self.device)

    def _size_kv_cache(self, plan: ShardPlan | None, group: TensorParallelGroup | None) -> None:
        """``num_blocks`` (the same on every rank) and ``max_model_len``."""
        config, mcfg = self.config, self.files.config
        heads = plan.num_kv_heads if plan else mcfg.num_kv_heads
        self._size_state_cache()
        self.num_blocks = local_num_blocks(
            config,
            self.device,
            self.kv_dtype,
            mcfg,
            heads,
            len(self.layers or ()),
            (self.num_state_slots + self.num_saved_states) * self.state_slot_bytes
            + self._lora_slot_bytes(),
        )
        if group is not None:
            self.num_blocks = group.all_reduce_min(self.num_blocks)  # what the tightest rank holds
        capacity = self.num_blocks * config.block_size
        limit = mcfg.context_length
        want = config.max_model_len
        if want is not None and want > limit:
            raise ValueError(f"max_model_len {want} exceeds the model's context length {limit}")
        if want is not None and want > capacity:
            raise ValueError(
                f"max_model_len {want} does not fit in the KV cache, which holds {capacity} tokens "
                f"({self.num_blocks} blocks); raise kv_cache_memory or lower max_model_len"
            )
        self.max_model_len = want or min(limit, capacity)
        if self.max_model_len < 2:
            raise ValueError(f"kv_cache_memory is too small: the KV cache holds {capacity} tokens")

    def _lora_slot_bytes(self) -> int:
        """On CUDA with ``enable_lora``: the bytes of ``--max-loras`` adapter slots
        (``model.lora_slots``, allocated as steps first use them), taken from the cache
        budget so that they always fit beside it."""
        cfg = self.config
        if not cfg.enable_lora or self.device.type != "cuda":
            return 0
        dtype = resolve_lora_dtype(cfg, self.device, self.weight_format)
        return slot_bytes(self.files.config, cfg.max_loras, cfg.max_lora_rank, dtype)

    def _size_state_cache(self) -> None:
        """A hybrid model's recurrent-state rows: a slot per ``max_num_seqs`` where they
        fit in half the cache budget, else as many as do (said); with prefix caching,
        ``SAVED_PER_SLOT`` saved states per slot where they fit in a quarter of it
        (``engine.state_cache``). The rest is KV blocks."""
        self.state_slot_bytes = self.model.state_bytes() if self.model is not None else 0
        self.num_state_slots = self.num_saved_states = 0
        if not self.state_slot_bytes:
            return
        want = self.config.max_num_seqs
        budget = kv_budget(self.config, self.device)
        fit = budget // 2 // self.state_slot_bytes
        self.num_state_slots = max(1, min(want, fit))
        if self.config.enable_prefix_caching:
            room = budget // 4 // self.state_slot_bytes
            self.num_saved_states = min(SAVED_PER_SLOT * self.num_state_slots, room)
        sb = self.state_slot_bytes
        size = f"{sb / 2**20:.2f} MiB" if sb >= 2**20 else f"{sb / 2**10:.1f} KiB"
        sys.stderr.write(
            f"structllm: recurrent state: {self.num_state_slots} slots of "
            f"{size} (one per running request"
            + (")\n" if fit >= want else f"; {want} asked, raise kv_cache_memory)\n")
        )
        if self.config.enable_prefix_caching:
            sys.stderr.write(
                f"structllm: prefix caching: on (a hybrid model: up to "
                f"{self.num_saved_states} recurrent states of {size} saved at block "
                "boundaries, where a cached prefix resumes)\n"
            )

    def _make_runner(self, plan: ShardPlan | None) -> ModelRunner | NullRunner:
        config = self.config
        if self.model is None:
            return NullRunner(config.null_step_time)
        broadcast = self.workers.publish if self.workers is not None else None
        sampler = Sampler(self.eos_token_ids, config.seed, self.model.cpu_ops)
        cls = ModelRunner if self.pooler_spec is None else PoolingRunner
        runner = cls(
            self.model,
            self.num_blocks,
            config.block_size,
            sampler,
            broadcast,
            self.kv_dtype,
            self.num_state_slots + self.num_saved_states,  # every row of the state tensors
        )
        runner.vision = self.vision
        runner.encoder_cache = EncoderCache(config.encoder_cache_memory)
        if isinstance(runner, PoolingRunner):
            assert self.pooler_spec is not None
            scorer = make_scorer(self.pooler_spec, self.files, self.model, self.device)
            runner.set_pooler(Pooler(self.pooler_spec, self.device, scorer))
            return runner  # (nothing to decode: no decode graphs)
        if self.stages > 1:
            assert self.group is not None
            tp = config.tensor_parallel_size
            runner.pp = PipelineLinks(self.group, 0, self.stages, 0, tp)
            # the step's share, as ring_capacity_for sized the ring for it
            runner.stage_feed = StageFeed(stage_budget(self.max_positions))
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.workers is None  # collectives are not captured in the decode graphs
            and self.model.attn_impl.supports_cuda_graphs
            and self.model.cuda_graphs  # (latent attention's reads host-side lists)
            and not self.hybrid  # (recurrent states are not captured)
            # (chunked layers decode through the reference on CUDA, which reads the
            # step's lengths on the host: not capturable)
            and not self.files.config.layer_chunks
        ):
            runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        return runner

    def _token_budget(self) -> int:
        """The per-step token budget: the configured one, else (on CPU, with a model) the
        one that keeps a measured prefill chunk near ``step_budget.TARGET_STEP_S``."""
        config = self.config
        if config.max_num_batched_tokens is not None:
            return config.max_num_batched_tokens
        if self.device.type != "cpu" or not isinstance(self.runner, ModelRunner):
            return max(DEFAULT_TOKEN_BUDGET, config.max_num_seqs)
        n = min(PROBE_TOKENS, self.max_model_len - 1)
        self._time_prefill(
            n
        )  # untimed: the first forward pays one-time costs (page faults, kernel set-up)
        seconds = min(self._time_prefill(n) for _ in range(3))  # the least disturbed of three
        budget = auto_token_budget(seconds / n, config.max_num_seqs)
        log.info(
            "step token budget %d (a %d-token prefill chunk took %.0f ms)",
            budget,
            n,
            1000 * seconds,
        )
        return budget

    def _time_prefill(self, n: int) -> float:
        """Seconds of one forward pass over an ``n``-token prompt chunk, as if this
        process had its threads' cores to itself. Leaves nothing
        behind: its blocks are freed and forgotten by the prefix cache, nothing is
        sampled (so no generator advances), no statistic counts it."""
        assert isinstance(self.runner, ModelRunner)
        vocab = self.vocab_size
        tokens = [
            (1 + 7919 * i) % vocab for i in range(n)
        ]  # any ids; the cost does not depend on them
        req = Request("\x00probe", tokens, SamplingParams(temperature=0.0, max_tokens=1), 1)
        if not self.kv.allocate(req, n):
            return 0.0  # a KV cache smaller than one chunk: nothing to measure
        if self.states is not None:
            self.states.allocate(req)  # (no request runs yet: a slot is free)
        try:
            batch = self.runner.prepare(SchedulerOutput([(req, n)]))
            if self.stages > 1:  # no logit rows: the last stage would sample (see run)
                batch = batch_from_step(
                    msgspec.structs.replace(batch.step, logit_rows=[]), self.runner.device
                )
            wall, cpu = time.perf_counter(), time.process_time()
            self.runner.run(batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            # Other processes busy on the cores at start-up (a parallel build, a test
            # run) stretch the wall time, not the CPU time our threads need: CPU time
            # over the thread count is the step's length on a machine of our own.
            return min(wall, cpu / torch.get_num_threads())
        finally:
            self.kv.free_blocks(req)
            self.kv.reset_prefix_cache()
            if self.states is not None:
                self.states.free_slot(req)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; a no-op otherwise)."""
        if self.workers is not None:
            self.workers.close()
        grammar: GrammarManager | None = getattr(self, "grammar", None)
        if grammar is not None:
            grammar.close()
        self.tracer.close()

    def release_idle_memory(self) -> None:
        """Hand back the heap the steps kept, once the engine has gone idle: on CPU the
        raised trim threshold (``device.keep_freed_memory_mapped``) keeps every step's
        activations mapped for the next one, up to the largest prefill chunk's (6 MB
        after a 64-token prompt, 19 MB after a 2000-token one, on the default model),
        and nothing else would return them while the engine waits. The first step after
        faults in what it uses again. Tensor-parallel workers keep theirs."""
        if self.device.type == "cpu":
            release_free_heap()

    @property
    def watch_fds(self) -> tuple[int, ...]:
        """Descriptors that become readable when a worker dies (for the idle wait)."""
        return self.workers.watch_fds if self.workers is not None else ()

    def check_workers(self) -> None:
        """Raise ``WorkerDied`` if a tensor-parallel worker has exited."""
        if self.workers is not None:
            self.workers.check()

    @property
    def vocab_size(self) -> int:
        return self.files.config.vocab_size

    # -- inputs ----------------------------------------------------------------------

    def check_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageInput] = (),
    ) -> None:
        """Raise ``ValueError`` if this request can never run here: among others, a
        token id it names (prompt, ``stop_token_ids``, ``logit_bias``) outside the
        vocabulary, or images the model cannot take (``check_images``)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; it needs at least one token")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        sampling.check_vocab(self.vocab_size)
        if sampling.max_tokens == 0:  # prompt only: nothing is generated
            if n > self.max_model_len:
                raise ValueError(
                    f"the prompt is {n} tokens, but max_model_len is {self.max_model_len}"
                )
        elif n >= self.max_model_len:
            raise ValueError(
                f"the prompt is {n} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        if images:
            self.check_images(prompt_token_ids, images)

    def check_priority(self, priority: int) -> None:
        """``ValueError`` (vLLM's message) for a non-zero priority under the fcfs policy."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")

    def check_images(self, ids: Sequence[int], images: Sequence[ImageInput]) -> None:
        """``ValueError`` naming what is wrong with a request's images: a model without
        a vision tower; a span out of the prompt, out of order or overlapping another;
        a span whose image-token count is not the image's ``num_tokens``, or that does
        not start and end on an image token; pixels not ``prod(shape)`` bytes; image
        tokens outside every span; what the model's encoder refuses (its shape). The null
        model (no forward pass: the serving path measured) carries images it cannot
        encode, checking only the spans' places and the pixels' size."""
        vision = self.vision
        if vision is None and self.model is not None:
            raise ValueError(f"this model ({self.files.name}) takes no images: {self.no_images}")
        tok = vision.image_token_id if vision is not None else None
        end = 0
        for k, im in enumerate(images):
            first, stop = im.offset, im.offset + im.length
            if im.length < 1 or first < 0 or stop > len(ids):
                raise ValueError(
                    f"image {k}'s span [{first}, {stop}) is not within the {len(ids)}-token prompt"
                )
            if first < end:
                raise ValueError(f"image {k}'s span overlaps or precedes the one before it")
            count = sum(1 for t in ids[first:stop] if t == tok)
            ends = ids[first] == tok and ids[stop - 1] == tok
            if tok is not None and (not ends or count != im.num_tokens):
                raise ValueError(
                    f"image {k}'s span [{first}, {stop}) holds {count} image tokens "
                    f"(id {tok}) and must start and end on one; the image has "
                    f"{im.num_tokens}"
                )
            if len(im.pixels) != math.prod(im.shape) or len(im.shape) != 4 or im.shape[3] != 3:
                raise ValueError(
                    f"image {k} has {len(im.pixels)} bytes of pixels for shape "
                    f"{list(im.shape)} (uint8 [tiles, height, width, 3])"
                )
            if vision is not None:
                vision.check(im)
            end = stop
        total = sum(1 for t in ids if t == tok)
        if tok is not None and total != sum(im.num_tokens for im in images):
            raise ValueError(
                f"the prompt has {total} image tokens (id {tok}), its images' spans "
                f"{sum(im.num_tokens for im in images)}"
            )

    def check_pooling(self, msg: AddRequest) -> None:
        """``ValueError`` unless ``msg`` is for this engine's runner: a pooling request
        (with ``dimensions`` the model can cut, no images) on the pooling runner, a
        generation request on the generate runner."""
        spec, params = self.pooler_spec, msg.pooling
        if spec is None and params is not None:
            raise ValueError(
                f"this model ({self.files.name}) runs the generate runner: it pools nothing "
                "(start another server with --runner pooling for embeddings)"
            )
        if spec is None or params is None:
            if spec is not None:
                raise ValueError(
                    f"this model ({self.files.name}) runs the pooling runner: it generates "
                    "nothing (embeddings and scores only)"
                )
            return
        if params.task != spec.task:
            raise ValueError(f"this model's pooler does {spec.task!r}, not {params.task!r}")
        if msg.images:
            raise ValueError("the pooling runner takes no images")
        if params.dimensions is not None:
            size = spec.info(self.files.config.hidden_size).size
            if not spec.matryoshka:
                raise ValueError(
                    f"this model ({self.files.name}) does not support matryoshka "
                    "representation: dimensions cannot be changed"
                )
            if params.dimensions > size:
                raise ValueError(f"dimensions {params.dimensions} exceeds the model's {size}")
            dims = spec.matryoshka_dimensions
            if dims and params.dimensions not in dims:
                raise ValueError(f"dimensions must be one of {dims}, got {params.dimensions}")

    def _mrope(self, images: Sequence[ImageInput]) -> MRopePositions | None:
        """The 3-D rotary positions of a prompt with ``images`` on an M-RoPE model
        (``engine.mrope``), else None (positions are token indices)."""
        if not images or self.vision is None or self.model is None:
            return None
        if not self.model.cfg.mrope_section:
            return None
        grids = [self.vision.token_grid(im) for im in images]
        return MRopePositions([(im.offset, *g) for im, g in zip(images, grids, strict=True) if g])

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request. One that can never run is answered with an ``error`` delta in
        the next batch instead (never left to spin). An engine request is one sequence:
        ``sampling.n`` must be 1 (the output processor, ``output.fan_out``, turns ``n``
        into ``n`` requests)."""
        try:
            if msg.sampling.n != 1:
                raise ValueError(
                    f"SamplingParams.n is {msg.sampling.n}, but an engine request is one sequence"
                )
            sampling = msg.sampling if msg.pooling is None else PROMPT_ONLY
            self.check_pooling(msg)
            self.check_request(msg.prompt_token_ids, sampling, msg.images)
            self.check_priority(msg.priority)
            if self._most_urgent is None or msg.priority < self._most_urgent:
                self._most_urgent = msg.priority  # see _check_every
            room = self.max_model_len - len(msg.prompt_token_ids)
            want = sampling.max_tokens
            max_tokens = room if want is None else min(want, room)
            req = Request(
                msg.request_id,
                msg.prompt_token_ids,
                sampling,
                max_tokens,
                list(msg.images),
                msg.priority,
            )
            req.pooling = msg.pooling
            req.mrope = self._mrope(req.images)
            if msg.request_id in self.scheduler.requests or msg.request_id in self._compiling:
                raise ValueError(f"request id {msg.request_id!r} is already in use")
            if msg.lora is not None:  # pinned until it ends (step: _unpin_finished)
                req.lora_uid = self._pin_adapter(msg.lora)
                self._lora_of[msg.request_id] = req.lora_uid
            if msg.sampling.structured_outputs is not None:
                # scheduled once its matcher is built (off this thread; see _admit_compiled)
                self._compiling[msg.request_id] = (req, self.grammar.compile(req))
                return
            self.scheduler.add_request(req)
        except ValueError as e:
            self._pending.append(TokenDelta(msg.request_id, [], "error", error=str(e)))
            self.tracer.event("finished", msg.request_id, reason="error", error=str(e))
            return
        self.tracer.event("queued", msg.request_id, prompt_tokens=len(msg.prompt_token_ids))

    def _pin_adapter(self, ref: LoraRef) -> int:
        """The uid of ``ref``'s adapter, loaded if need be and pinned (``ValueError``:
        LoRA is off, or the adapter cannot run here)."""
        if self.adapters is None:
            raise ValueError(
                f"the request names LoRA adapter {ref.name!r}, but LoRA is not enabled "
                "(--enable-lora)"
            )
        return self.adapters.acquire(ref).uid

    def _unpin_finished(self, deltas: Sequence[TokenDelta]) -> None:
        """Unpin the adapters of the requests that ended in this batch."""
        assert self.adapters is not None
        for d in deltas:
            if d.finish_reason is not None and d.request_id in self._lora_of:
                self.adapters.release(self._lora_of.pop(d.request_id))

    def _admit_compiled(self, wait_s: float = 0.0) -> None:
        """Schedule the constrained requests whose matcher is ready; one whose grammar
        failed ends alone with an ``error`` delta. With ``wait_s``, wait that long for
        the first one to finish (when the step has nothing else to do)."""
        if wait_s > 0 and self._compiling:
            wait([f for _, f in self._compiling.values()], wait_s, return_when=FIRST_COMPLETED)
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            result = future.result()
            if isinstance(result, str):
                self._pending.append(TokenDelta(rid, [], "error", error=result))
                continue
            self.grammar.attach(req, result)
            self.scheduler.add_request(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        before = len(self._pending)
        for rid in ids:
            entry = self._compiling.pop(rid, None)
            if entry is not None:  # its matcher, when built, is dropped unattached
                entry[1].cancel()
                self._pending.append(TokenDelta(rid, [], "abort", None, 0))
        self._pending += self.scheduler.abort(ids)
        self.num_aborted += len(self._pending) - before
        if isinstance(self.runner, PoolingRunner):
            self.runner.forget(ids)
        if self.tracer.enabled:
            for rid in ids:
                self.tracer.event("aborted", rid)
                self._traced_blocks.pop(rid, None)

    def handle(self, msg: ToEngine) -> bool:
        """Apply one inbound message; returns False on ``Shutdown``."""
        if isinstance(msg, AddRequest):
            self.add_request(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_ids)
        elif isinstance(msg, Shutdown):
            return False
        elif isinstance(msg, GetStats):
            pass  # the next batch carries fresh stats
        return True

    # -- the step --------------------------------------------------------------------

    @property
    def requests_in_flight(self) -> frozenset[str]:
        """Ids of the requests in batches submitted and not completed (pipeline)."""
        return frozenset(self._busy)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling) or bool(self._in_flight)

    def step(self, pending: Callable[[], Held] | None = None) -> OutputBatch:
        """``_step``, then the adapters of the requests it ended are unpinned."""
        batch = self._step(pending)
        if self._lora_of:
            self._unpin_finished(batch.outputs)
        return batch

    def _step(self, pending: Callable[[], Held] | None = None) -> OutputBatch:
        """Schedule and run one step; its outputs (and any refusals and aborts since the
        last step) as one batch.

        ``pending``: the messages that have arrived but are held by the caller until the
        step ends (the engine loop peeks at its rings while the model runs). When their
        aborts cover every request of the running step, or (priority policy) one of
        their requests is strictly more urgent than all of the step's (``Held``), the
        step is cut short between layers (``llama.CHECK_EVERY``): nothing is sampled,
        no request advances, and the K/V blocks registered for its uncomputed tokens
        leave the prefix cache. The caller must then apply those messages before the
        next step. So a storm of requests dropped by their clients, or a long
        less-urgent prefill, costs a newcomer a few layers of waiting, not the rest of
        the step. Not with tensor or pipeline parallelism (a pipeline's step is
        ``_pipelined_step``)."""
        if self._compiling:
            self._admit_compiled(0.0 if self.scheduler.has_work else COMPILE_WAIT_S)
        if self.pipeline_depth > 1:
            return self._pipelined_step()
        sched = self.scheduler.schedule()
        deltas, self._pending = self._pending, []
        if sched.scheduled:
            start = 0
            if self.tracer.enabled:
                start = now_us()
                self._trace_scheduled(sched)
            check = None
            floor = None  # under priority, arrivals more urgent than this cut the step
            if pending is not None:  # ModelRunner.run drops it with tensor parallelism
                ids = {req.request_id for req, _ in sched.scheduled}
                if self.scheduler.policy == "priority":
                    floor = min(req.priority for req, _ in sched.scheduled)

                def check() -> None:
                    reason = pending().cut_reason(ids, floor)
                    if reason is not None:
                        raise StepCutShort(reason)

            try:
                with self._check_every(floor):
                    sampled, logprobs, prompt_logprobs = self.runner.execute(sched, check)
            except StepCutShort as cut:
                for req, _ in sched.scheduled:
                    req.draft_token_ids = []
                    self.kv.forget_uncomputed(req)
                if self.states is not None:  # no planned save was written whole
                    self.states.forget_uncomputed([req for req, _ in sched.scheduled])
                self.num_steps_cut += 1
                if self.tracer.enabled:
                    self.tracer.span("step", start, step=self.num_steps, cut_short=str(cut))
                return OutputBatch(deltas, self.stats())
            except BaseException as e:
                if self.workers is not None:
                    self._abandon_step(self.workers, e)
                raise
            self.num_steps += 1
            self.max_in_flight = max(self.max_in_flight, 1)
            new = self.scheduler.update(sched, sampled, logprobs, prompt_logprobs)
            runner = self.runner
            if isinstance(runner, ModelRunner) and runner.vision is not None:
                # split spans' images stay cached (a model without a vision side has none)
                running = self.scheduler.running
                runner.encoder_cache.hold(h for r in running for h in r.open_images())
            if isinstance(self.runner, PoolingRunner):  # the vectors pooled this step
                new = self.runner.attach(new)
            if self.tracer.enabled:
                self._trace_step(sched, new, start)
            deltas += new
        return OutputBatch(deltas, self.stats())

    def _check_every(self, floor: int | None) -> contextlib.AbstractContextManager[None]:
        """The step's check for arrivals after every layer of the Python layer loop
        (not ``llama.CHECK_EVERY``) when an arrival may cut it: under the priority
        policy, once a request strictly more urgent than the step's least urgent
        (``floor``) has been seen. A newcomer then waits one layer of a long prefill
        step, not up to ``CHECK_EVERY``; fcfs, and a server whose requests all share one
        priority, keep the coarser check (nothing for it to cut). (A plain context
        when nothing changes: a generator's costs a few us of every cold step.)"""
        model = self.model
        if floor is None or model is None or self._most_urgent is None:
            return contextlib.nullcontext()
        if self._most_urgent >= floor:
            return contextlib.nullcontext()
        return self._every_layer(model)

    @staticmethod
    @contextlib.contextmanager
    def _every_layer(model: LlamaModel) -> Iterator[None]:
        """``model``'s Python layer loop checks after every layer for the duration."""
        every, model.check_every = model.check_every, 1
        try:
            yield
        finally:
            model.check_every = every

    def _pipelined_step(self) -> OutputBatch:
        """A step with pipeline parallelism (vLLM's virtual engines): submit batches of
        requests not in flight until ``pipeline_depth`` are (each runs stage 0 here and
        goes on to the next stage, which works on it while this rank runs the next),
        then complete the oldest: its logits arrive from the last stage, in order, and
        are sampled. Each batch takes at most its share of the live requests, so they
        spread over the batches in flight instead of all riding in the first. A request
        aborted while its batch is in flight is skipped when the batch completes; one in
        flight is never preempted (``Scheduler.schedule``'s ``busy``). Not cut short."""
        runner = self.runner
        assert isinstance(runner, ModelRunner)
        sched_ = self.scheduler
        deltas, self._pending = self._pending, []
        try:
            while len(self._in_flight) < self.pipeline_depth:
                live = len(sched_.running) + len(sched_.waiting)
                share = max(1, -(-live // self.pipeline_depth))
                sched = sched_.schedule(self._busy, share)
                if not sched.scheduled:
                    break
                start = now_us() if self.tracer.enabled else 0
                if self.tracer.enabled:
                    self._trace_scheduled(sched)
                self._in_flight.append((sched, runner.submit(sched), start))
                self._busy.update(req.request_id for req, _ in sched.scheduled)
                self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
            if self._in_flight:
                sched, job, start = self._in_flight.popleft()
                self._busy.difference_update(req.request_id for req, _ in sched.scheduled)
                sampled, logprobs, prompt_logprobs = runner.complete(job)
                self.num_steps += 1
                new = sched_.update(sched, sampled, logprobs, prompt_logprobs)
                if self.tracer.enabled:
                    self._trace_step(sched, new, start)
                deltas += new
        except BaseException as e:
            self._in_flight.clear()
            self._busy.clear()
            if self.workers is not None:
                self._abandon_step(self.workers, e)
            raise
        return OutputBatch(deltas, self.stats())

    def _trace_scheduled(self, sched: SchedulerOutput) -> None:
        for req, n in sched.scheduled:
            self.tracer.event("scheduled", req.request_id, tokens=n)
            held, before = len(req.block_ids), self._traced_blocks.get(req.request_id, 0)
            if held > before:
                self.tracer.event(
                    "blocks_allocated", req.request_id, blocks=held - before, total=held
                )
            self._traced_blocks[req.request_id] = held

    def _trace_step(self, sched: SchedulerOutput, deltas: list[TokenDelta], start: int) -> None:
        self.tracer.span(
            "step",
            start,
            step=self.num_steps,
            tokens=sched.num_tokens,
            requests=len(sched.scheduled),
        )
        for req, _ in sched.scheduled:
            self.tracer.event("forward", req.request_id, step=self.num_steps)
        for d in deltas:
            if d.new_token_ids:
                self.tracer.event("sampled", d.request_id, tokens=len(d.new_token_ids))
            if d.finish_reason is not None:
                self.tracer.event("finished", d.request_id, reason=d.finish_reason)
                self._traced_blocks.pop(d.request_id, None)

    @staticmethod
    def _abandon_step(workers: WorkerPool, error: BaseException) -> None:
        """A tensor-parallel step failed or was interrupted part-way (a worker died, or
        Ctrl-C between two collectives): the ranks are at different collectives and can
        never pair up again, so the workers are stopped. Raises ``WorkerDied`` naming
        the worker if one died (a failed collective says only "connection reset")."""
        try:
            if isinstance(error, RuntimeError):
                workers.raise_if_dead(error)
        finally:
            workers.close()

    @property
    def num_live_matchers(self) -> int:
        """Grammar matchers held for live constrained requests (0 once all ended)."""
        return len(self.grammar.matchers)

    def stats(self) -> EngineStats:
        s = self.scheduler
        spec = s.drafter.stats if s.drafter is not None else SpecStats(0)
        st = self.states
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(self._compiling),
            num_waiting_by_priority=self._waiting_by_priority(),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.num_queried_tokens,
            prefix_cache_hits=self.kv.num_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_prompt_tokens=s.num_prompt_tokens,
            num_generation_tokens=s.num_generation_tokens,
            num_steps=self.num_steps,
            num_grammar_matchers=len(self.grammar.matchers),
            num_grammar_ff_tokens=self.grammar.num_ff_tokens,
            num_steps_cut=self.num_steps_cut,
            num_aborted=self.num_aborted,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_pos),
            state_cache_slots_used=st.num_slots - st.num_free_slots if st is not None else 0,
            spec_propose_s=spec.propose_s,
            **self._encoder_stats(),
            lora_running=self._lora_names(s.running),
            lora_waiting=self._lora_names(s.waiting),
        )

    def _waiting_by_priority(self) -> dict[int, int]:
        """Waiting requests (constrained ones whose matcher is being built included)
        counted by priority."""
        if not self.scheduler.waiting and not self._compiling:  # a running step's usual case
            return {}
        compiling = (req for req, _ in self._compiling.values())
        return dict(Counter(r.priority for r in chain(self.scheduler.waiting, compiling)))

    def _lora_names(self, reqs: Iterable[Request]) -> list[str]:
        """The names of ``reqs``' adapters (none without LoRA)."""
        if self.adapters is None:
            return []
        names = self.adapters.by_uid
        return sorted({names[r.lora_uid].name for r in reqs if r.lora_uid in names})

    def _encoder_stats(self) -> dict[str, int]:
        if not isinstance(self.runner, ModelRunner):
            return {}
        enc = self.runner.encoder_cache
        return dict(
            encoder_cache_queries=enc.num_hits + enc.num_misses,
            encoder_cache_hits=enc.num_hits,
            encoder_cache_bytes=enc.num_bytes,
        )
