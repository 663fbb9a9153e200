"""Engine configuration: what the CLI, the offline API and the engine process share."""

from __future__ import annotations

import importlib.util
import json
from typing import Any, Literal

import msgspec

GiB = 1 << 30

SPEC_METHODS = ("ngram", "suffix", "none")
RUNNERS = ("auto", "generate", "pooling")
PoolingType = Literal["LAST", "MEAN", "CLS"]


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding without a draft model (``--speculative-config``, vLLM's
    JSON keys). Drafts are verified by each request's own sampler, so the output is the
    same as without them (see ``engine.speculative``).

    - ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest
      earlier occurrence of the sequence's last ``prompt_lookup_min`` ..
      ``prompt_lookup_max`` tokens) or ``"suffix"`` (a suffix index over this request's
      tokens and the outputs of recent requests, as vLLM's suffix decoding), or
      ``"none"``: off, whatever the default (the other keys are then ignored).
    - ``num_speculative_tokens``: most drafts per request and step (default 7: with the
      newest token, 8 rows, what the CPU row kernel serves; see below).
    - ``disable_by_batch_size``: no drafts in a step with more running requests than
      this (verifying costs rows that a large batch already fills); ``None``: always.
    - ``max_step_tokens``: drafts only while the running requests' tokens in the step
      (drafts included; prompts admitted after them do not count) stay within this.
      ``None``: on CPU with GGUF block weights, each request's draft length is chosen
      from its recent acceptance and the measured cost of a step by rows
      (``core.DRAFT_STEP_COST``, up to ``packed.ROW_KERNEL_ROWS`` rows: 8, 5 on the
      AVX2 build; see ``engine.speculative``); elsewhere no limit. Set, it keeps the
      fixed length ``num_speculative_tokens`` within this many rows.
    - ``min_acceptance``: (fixed length only) a request whose drafts were accepted at a
      lower rate, over at least ``acceptance_window`` drafted tokens, stops drafting
      (default 0.2: below it, a 4-row verification step costs more than the tokens it
      adds). The chosen length stops where one draft alone stops paying instead.
    - ``suffix_decoding_max_tree_depth``: the longest suffix matched (suffix method).
    - ``suffix_decoding_max_cached_requests``: finished requests whose outputs the
      suffix method keeps indexed.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 7
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    max_step_tokens: int | None = None
    min_acceptance: float = 0.2
    acceptance_window: int = 32
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be in [1, 64], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                "speculative_config.disable_by_batch_size must be at least 1, "
                f"got {self.disable_by_batch_size}"
            )
        if self.max_step_tokens is not None and self.max_step_tokens < 2:
            raise ValueError(
                f"speculative_config.max_step_tokens must be at least 2, got {self.max_step_tokens}"
            )
        if not 0.0 <= self.min_acceptance <= 1.0 or self.acceptance_window < 1:
            raise ValueError(
                "speculative_config needs 0 <= min_acceptance <= 1 and acceptance_window >= 1"
            )
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                "speculative_config needs suffix_decoding_max_tree_depth >= 1 and "
                "suffix_decoding_max_cached_requests >= 0"
            )


def speculative_config(value: object) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON text, a dict of its keys, a ``SpeculativeConfig``
    or ``None`` -> the config (``None``: off). Raises ``ValueError`` naming the problem."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, str | bytes):
            return msgspec.json.decode(value, type=SpeculativeConfig)
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"speculative_config: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"speculative_config is not valid JSON: {e}") from None


def hf_overrides(value: object) -> dict[str, Any] | None:
    """``--hf-overrides``' JSON text, or a dict, as the dict of ``config.json`` keys it
    sets; ``ValueError`` for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides is not valid JSON: {e}") from None
    if value is not None and not (
        isinstance(value, dict) and all(isinstance(k, str) for k in value)
    ):
        raise ValueError(f"hf_overrides must be a JSON object of config.json keys, got {value!r}")
    return value


class PoolerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--pooler-config`` (vLLM's keys): how to pool (``LAST``, ``MEAN``, ``CLS``) and
    whether to normalise; ``None`` keeps what the model's files say."""

    pooling_type: PoolingType | None = None
    normalize: bool | None = None


def pooler_config(value: object) -> PoolerConfig | None:
    """``--pooler-config``'s JSON text, or a dict, as a ``PoolerConfig``; ``ValueError``
    naming what is wrong."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    try:
        if isinstance(value, str):
            return msgspec.json.decode(value, type=PoolerConfig)
        return msgspec.convert(value, PoolerConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"pooler_config: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"pooler_config is not valid JSON: {e}") from None


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Settings of one engine. ``None`` means "derive from the model and the device".

    - ``model``: a GGUF file, a Hugging Face directory, or ``None`` for the default model.
    - ``max_model_len``: longest prompt + output, in tokens; capped by the model's context
      length and by what the KV cache can hold.
    - ``max_num_batched_tokens``: the per-step token budget; prompts longer than it are
      prefilled in chunks. ``None``: 2048 on CUDA; on CPU, what keeps a step near 200 ms
      as measured at start-up (``engine.step_budget``), since a request that arrives
      during a step, and an abort, wait for the step to end.
    - ``kv_cache_memory``: bytes for the KV pool. On CUDA the default is
      ``gpu_memory_utilization`` of the memory left after loading the weights.
    - ``attention_backend``: ``"auto"`` (Triton on CUDA; on CPU the C++ decode kernel,
      built on first use, else torch), ``"torch"`` (the reference), ``"cpu"`` or
      ``"triton"`` (on CPU only with ``TRITON_INTERPRET=1``; for tests).
    - ``dtype``, ``quantization``: the weights' format (see ``model.formats``). On CPU,
      ``auto``/``auto`` keeps a GGUF file's blocks (C++ kernels; see ``--quantization``) and runs
      float checkpoints with float16 matmul weights; ``float32``/``none`` is the exact
      float32 path. Activations are float32 on CPU either way.
    - ``num_threads``: torch's threads on CPU (``--engine-threads``); default: the cores
      this process may run on, divided among the tensor-parallel ranks.
    - ``kv_cache_dtype``: what the paged KV cache stores, ``"auto"``, ``"float32"`` or
      ``"float16"`` (vLLM's flag name). Attention converts on the store and reads it back
      in float32 (the C++ kernel with F16C). ``auto``: on CPU float16 unless the weights
      run in the exact float32 format (``--dtype float32 --quantization none``, or a float
      checkpoint that resolves to it), which keeps float32 so that path stays equal to
      transformers; with bfloat16 activations, bfloat16; on CUDA the model's dtype.
      float16 halves the bytes per block, so ``kv_cache_memory`` holds twice the tokens.
    - ``cpu_activations``: on CPU, the precision of the activations in GGUF block matmuls
      (``kernels.packed.block_mode``): ``"auto"`` rounds them to 8 bits per block of 32 in
      the MLP's 4- and 5-bit matmuls and to 16 bits elsewhere; ``"int16"``: 16 bits in
      every block matmul (closer to float32, slower on many rows); ``"int8"``: 8 bits in
      the MLP's matmuls of every type the int8 kernels run (Q8_0 too, as llama.cpp does).
      Accuracy against llama.cpp on the same file: ``bench/accuracy.py``. Batch-invariant
      on every path.
    - ``null_model``: run everything but the forward pass (``engine.null``): tokens come
      from a cheap deterministic function, ``null_step_time`` seconds per step. The
      model's tokenizer and shape (for KV sizing) are still used.
    - ``enforce_eager``: on CUDA, run every step eagerly instead of replaying CUDA graphs
      captured for decode-only steps (as vLLM's option of that name).
    - ``tensor_parallel_size``: split the model over this many processes (this one and
      N-1 workers; gloo on CPU, NCCL on CUDA devices ``cuda:0..N-1``), Megatron-style
      (see ``model.sharding``). Attention heads are split by KV-head group: with fewer KV
      heads than N the KV heads are replicated, which needs N to be a multiple of the KV
      heads; when N does not divide the KV heads the ranks hold one group more or less.
      A model that cannot be split is refused with a ``ValueError`` naming the numbers.
      ``kv_cache_memory`` is per rank. Ignored with ``null_model`` (no model to split).
    - ``grammar_fast_forward``: when a constrained request's grammar forces its next
      tokens, append them in one step (computed like a prompt chunk) instead of one
      decode step each; the output is the same either way (see ``engine.grammar``).
    - ``speculative_config``: speculative decoding (``SpeculativeConfig``; method
      ``"none"``: off); ``None``: ``core.SPECULATIVE_BY_DEFAULT`` (on: n-gram with the
      adaptive draft length on CPU with GGUF block weights, where outputs are equal by
      construction; off elsewhere).
    - ``trace``: a file to append the lifecycle events of every request to (see
      ``structllm.trace``); ``None``: off.
    - ``pipeline_parallel_size``: split the decoder layers into this many stages, one
      process each (``model.stages``); each step's residual stream goes from stage to
      stage, the last sends the logits to rank 0, which samples; one batch in flight at a
      time. With ``tensor_parallel_size`` T too, each stage is T ranks (rank = stage * T
      + TP rank), tensor-parallel among themselves.
    - ``nnodes``, ``node_rank``, ``master_addr``, ``master_port`` (torchrun's names):
      the ranks (tensor-parallel or pipeline stages) spread over ``nnodes`` hosts,
      ``ranks // nnodes`` on each. This engine is node 0: it hosts the process group's ``TCPStore``
      at ``master_addr:master_port`` (which must be this host's address as the others
      reach it) and rank 0; the other nodes run ``structllm run --node-rank R`` with the
      same four settings (``engine.node``). ``node_addr``: the address this node's
      collectives bind to (default ``master_addr`` on node 0). ``distributed_timeout``:
      seconds any collective or step send may wait for another rank before the step
      fails and the engine ends (a dead rank is usually noticed at once, by its closed
      connections; the bound is for a host that vanishes).
    - ``distributed_executor_backend``: ``"mp"`` (the engine spawns its ranks, and other
      nodes run ``engine.node``) or ``"ray"`` (ranks 1..N-1 are Ray actors in a placement
      group of an existing Ray cluster, ``engine.ray_executor``; needs ``pip install
      'structllm[ray]'``).
    - ``hf_overrides``: keys set over the model's ``config.json`` (vLLM's option), e.g.
      ``{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768}}`` for Qwen3's longer context (a YaRN
      scaling extends the context to its original length times its factor); a GGUF file
      takes ``rope_scaling``, ``rope_parameters``, ``rope_theta`` and
      ``max_position_embeddings``.
    - ``generation_config``: where unset request parameters (``temperature``, ``top_p``,
      ``top_k``, ``min_p``, ``repetition_penalty``) take their defaults from, as vLLM's
      flag: ``"auto"``, the model directory's ``generation_config.json`` (its creator's
      recommendation; a GGUF file has none); ``"vllm"``, the API's own defaults; or a
      folder holding a ``generation_config.json``.
    - ``mmproj``: llama.cpp's mmproj GGUF (a vision tower and projector, written by its
      ``convert_hf_to_gguf.py --mmproj``) for a GGUF ``model`` of a family with images
      (Gemma 3, SmolVLM's Llama): ``model/mmproj.py``; refused for a directory, another
      family, or a projector that does not fit the model.
    - ``scheduling_policy``: ``"fcfs"`` (arrival order) or ``"priority"`` (a request's
      ``priority``, lower first, then arrival; a more urgent request may preempt a less
      urgent one: ``engine.scheduler``), vLLM's ``--scheduling-policy``.
    - ``enable_lora`` (vLLM's flags): requests may name a LoRA adapter
      (``AddRequest.lora``), run over the unmerged base (``engine.adapters``,
      ``model.lora``); ``max_loras``: distinct adapters in one step (a waiting request
      over it is passed over); ``max_cpu_loras``: adapters kept loaded (default
      ``max_loras``; those in use are never evicted); ``max_lora_rank``: larger ranks
      are refused; ``lora_dtype``: how their weights are stored (``auto``: float32 on
      the exact float32 path and on CUDA, else float16; computed in float32 on CPU
      always: ``model.formats.resolve_lora_dtype``). With tensor parallelism each rank
      holds its slices of the adapters; not with pipeline parallelism.
    - ``encoder_cache_memory``: bytes for a vision-language model's encoder outputs, kept
      by image hash (``engine.encoder_cache``; a 256-token Gemma 3 image at hidden 2560
      in float32 is 2.5 MiB).
    - ``runner``: ``"generate"`` (text generation), ``"pooling"`` (embeddings and
      scores: prefill only, one vector per request, ``engine.pooling``) or ``"auto"``:
      pooling for an embedding checkpoint (``model.pooler_config``), else generate.
      One engine runs one runner (vLLM's ``--runner``).
    - ``pooler_config``: the pooling runner's pooling and normalisation over what the
      model's sentence-transformers files say (``PoolerConfig``).
    """

    model: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    cpu_activations: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    num_threads: int | None = None
    null_model: bool = False
    null_step_time: float = 0.0
    tensor_parallel_size: int = 1
    grammar_fast_forward: bool = True
    speculative_config: SpeculativeConfig | None = None
    trace: str | None = None
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    node_addr: str | None = None
    distributed_timeout: float = 60.0
    distributed_executor_backend: str = "mp"
    hf_overrides: dict[str, Any] | None = None
    generation_config: str = "auto"
    encoder_cache_memory: int = 256 << 20
    mmproj: str | None = None
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_dtype: str = "auto"
    runner: str = "auto"
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {bs}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.encoder_cache_memory < 0:
            raise ValueError(f"encoder_cache_memory must be >= 0, got {self.encoder_cache_memory}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.quantization not in ("auto", "none", "gguf"):
            raise ValueError(f"quantization must be auto, none or gguf, got {self.quantization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.cpu_activations not in ("auto", "int8", "int16"):
            raise ValueError(
                f"cpu_activations must be auto, int8 or int16, got {self.cpu_activations!r}"
            )
        if self.kv_cache_dtype not in ("auto", "float32", "float16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32 or float16, got {self.kv_cache_dtype!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}"
            )
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.nnodes < 1 or ranks % self.nnodes:
            raise ValueError(
                f"the ranks (tensor_parallel_size x pipeline_parallel_size = {ranks}) must be "
                f"a multiple of nnodes {self.nnodes} (the same number of ranks on every node)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError("several nodes need --master-port (the store's port on node 0)")
        hf_overrides(self.hf_overrides)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} "
                f"and {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        if self.lora_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"lora_dtype must be auto, float32, float16 or bfloat16, got {self.lora_dtype!r}"
            )
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be mp or ray, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "ray":
            if not module_available("ray"):
                raise ValueError(
                    "distributed_executor_backend 'ray' needs Ray, which is not installed: "
                    "pip install 'structllm[ray]'"
                )
            if self.nnodes > 1:
                raise ValueError("with the ray backend Ray places the ranks: drop --nnodes")
        if self.distributed_timeout <= 0:
            raise ValueError(
                f"distributed_timeout must be positive, got {self.distributed_timeout}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, cpu or triton, "
                f"got {self.attention_backend!r}"
            )


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def engine_default(name: str) -> object:
    """The default of ``EngineConfig.<name>`` (for the CLI's defaults)."""
    return next(f.default for f in msgspec.structs.fields(EngineConfig) if f.name == name)


DEFAULT_CPU_KV_CACHE_MEMORY = 1 * GiB


def parse_size(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"2GiB"`` or plain bytes -> bytes."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512M, 2G or a byte count)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * mult)
