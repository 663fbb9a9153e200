"""Every type that crosses the front end / engine process boundary.

All are frozen ``msgspec.Struct``s. Messages on the rings are tagged unions (the tag is
the class name), so one ``Decoder`` per direction decodes any of them; the per-step hot
types are ``array_like`` (encoded as msgpack arrays, no field names on the wire) and
``gc=False`` (they hold no reference cycles).

``SamplingParams`` doubles as the user-facing type of the offline API
(``structllm.SamplingParams``); its ``__post_init__`` rejects bad values with a
``ValueError`` naming the field, which msgspec turns into a ``ValidationError`` when a
frame is decoded.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 4

FinishReason = Literal["stop", "length", "abort", "error"]


class StructuredOutputs(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    """A constraint on a sequence's output (the shape of vLLM's
    ``StructuredOutputsParams``). Exactly one of the constraint fields is set:

    - ``json``: a JSON schema, as a dict or as JSON text; the output is a JSON value valid
      against it (unsupported keywords are an error, not ignored);
    - ``json_object``: ``True``: any JSON object (``False`` counts as not set);
    - ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar in llguidance's dialect (``start:`` is the root; it may
      embed ``%json {...}`` schemas).

    ``whitespace_flexible`` (JSON only): allow any whitespace between JSON tokens. Off by
    default (unlike vLLM): JSON is then written with fixed ``", "`` and ``": "``
    separators and no other whitespace, so a small model cannot ramble in whitespace,
    and the text between values is forced, which grammar fast-forward exploits.

    Checked here only for shape; whether the schema, regex or grammar compiles is
    ``structllm.structured.validate``'s job (the front end calls it before the engine).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "StructuredOutputs needs exactly one of json, json_object, regex, choice, "
                f"grammar (got {got})"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("StructuredOutputs.choice must list at least one string")

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set (``"json"``, ``"regex"``, ...)."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class Reasoning(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The output opens with a reasoning part that ends with the token sequence
    ``end_token_ids`` (a reasoning parser's end tag, e.g. ``</think>``, as the front end
    tokenized it). A constraint (``structured_outputs``) applies only to the tokens after
    it: the reasoning is sampled unconstrained, and the grammar starts once the output's
    last tokens are exactly these (``structllm.reasoning``; the engine knows no tags)."""

    end_token_ids: list[int]

    def __post_init__(self) -> None:
        if not self.end_token_ids or any(t < 0 for t in self.end_token_ids):
            raise ValueError(
                "SamplingParams.reasoning.end_token_ids must be a non-empty list of token ids"
            )


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to sample one sequence. Defaults follow vLLM's ``SamplingParams``.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. Presence and frequency penalties apply to generated tokens (OpenAI's
    definition); the repetition penalty applies to prompt and generated tokens (the
    Hugging Face / CTRL definition). ``logprobs=N`` returns the sampled token's logprob
    and the N most likely alternatives, computed from the model's raw logits (for a
    constrained request, as in vLLM, after the grammar's mask: disallowed tokens have
    logprob -inf). ``stop`` strings are handled by the detokenizing layer, the rest by
    the engine. ``structured_outputs`` constrains the output to a grammar (see
    ``StructuredOutputs``); the grammar ending wins over ``min_tokens`` and
    ``ignore_eos`` (the request then finishes with ``"stop"``). With ``reasoning`` the
    constraint starts after the output's reasoning part (see ``Reasoning``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} {why}")

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not (-2.0 <= v <= 2.0):
                raise bad(name, f"must be in [-2, 2], got {v}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", f"must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                raise bad("logit_bias", f"keys must be non-negative token ids, got {t}")
            if not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise bad("logit_bias", f"values must be in [-100, 100], got {b} for token {t}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative token ids")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise bad("seed", "must fit in 64 bits")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the field if a token id it names (``stop_token_ids``,
        ``logit_bias`` keys) lies outside ``[0, vocab_size)``: the checks that need the
        model. The engine applies them to every request; a front end may call this early
        to answer 400 (the message starts with ``SamplingParams.<field>``)."""
        named = (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or ()),
            ("reasoning", self.reasoning.end_token_ids if self.reasoning else ()),
        )
        for name, ids in named:
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"SamplingParams.{name} contains token id {bad}, "
                    f"outside the vocabulary [0, {vocab_size})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


# ---------------------------------------------------------------------------------------
# front end -> engine


class ImageInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One image of a prompt, as the model's image processor left it in the front end
    (``structllm.multimodal``): decoded, resized and tiled, not yet normalised.

    Its embeddings take the prompt positions ``offset .. offset + length - 1`` whose
    token is the model's image token, in order (a family may put other tokens between
    an image's tiles, e.g. Idefics3's row markers). ``hash`` keys the engine's encoder
    cache and the prefix cache's blocks over the span: a full-length hash of the
    decoded pixels and the processor's settings, so two different images never share
    either."""

    hash: str  # sha256 hex
    offset: int  # prompt position of the span's first token
    length: int  # the span's positions, first image token to last
    num_tokens: int  # image-token positions in the span (= the encoder's output rows)
    shape: tuple[int, int, int, int]  # [tiles, height, width, 3]
    pixels: bytes  # uint8, ``shape``, row-major RGB


class LoraRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A LoRA adapter a request runs with (vLLM's ``LoRARequest``): its served name, an
    id unique to these files (a fresh one for every load of a name), and its PEFT
    directory. The engine loads it on first use (``engine.adapters``)."""

    name: str
    lora_id: int
    path: str


PoolingTask = Literal["embed", "score"]


class PoolingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request for the pooling runner (``engine.pooling``): no token is generated;
    the prompt is prefilled and pooled into one float32 vector (``TokenDelta.pooled``).

    - ``task``: ``"embed"`` (the model's embedding, after its Dense layers) or
      ``"score"`` (a reranker's relevance, one number);
    - ``dimensions``: keep the embedding's first N entries (a Matryoshka model), then
      normalise if the model's pooler does;
    - ``normalize``: override the pooler's normalisation (``None``: the model's)."""

    task: PoolingTask = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"PoolingParams.dimensions must be at least 1, got {self.dimensions}")


class AddRequest(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = []  # in prompt order, spans disjoint
    priority: int = 0  # lower runs earlier (--scheduling-policy priority; else only 0)
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model
    pooling: PoolingParams | None = None  # a pooling runner's request (prefill only)


class Abort(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """Idempotent: ids that are unknown or already finished are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


class GetStats(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Ask the engine to emit an ``OutputBatch`` with fresh stats even when idle."""


ToEngine = AddRequest | Abort | Shutdown | GetStats


# ---------------------------------------------------------------------------------------
# engine -> front end


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprob of one sampled (or prompt) token and its ``top_ids``/``top_logprobs``
    alternatives (most likely first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class TokenDelta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What one engine step did for one request.

    ``finish_reason`` is set on the request's last delta. ``stop_reason`` is the stop
    token id that ended it, if any. ``error`` explains ``finish_reason == "error"``
    (a request the engine refused, e.g. a prompt that can never fit).

    ``prompt_logprobs`` (requests with ``SamplingParams.prompt_logprobs``): the scores
    of the prompt positions this step's prefill chunk computed, in order. Concatenated
    over a request's deltas they are exactly ``prompt_len - 1`` entries, entry ``k``
    scoring prompt token ``k + 1`` (``logprob`` is that token's; the first prompt token
    has no score), each sent once, even across preemption. A chunk that samples nothing
    gets a delta of its own with no ``new_token_ids``.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    stop_reason: int | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    pooled: bytes | None = None  # float32 [D], native order: a pooling request's vector


class EngineStats(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Scheduler and KV cache state after a step; counters are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0  # model steps run
    num_grammar_matchers: int = 0  # live matchers of constrained requests
    num_grammar_ff_tokens: int = 0  # tokens appended by grammar fast-forward (decode steps saved)
    num_steps_cut: int = 0  # steps cut short: all aborted, or an urgent arrival (Held)
    num_aborted: int = 0  # live requests aborted (client gone, stop string, write timeout)
    # speculative decoding (engine.speculative): drafted chunks verified, drafted and
    # accepted tokens, accepted drafts by position, seconds in the proposer
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    spec_propose_s: float = 0.0
    # hybrid models: recurrent-state slots held by requests (engine.state_cache)
    state_cache_slots_used: int = 0
    # vision-language models: images looked up in the encoder cache (engine.encoder_cache)
    # and found there, and the bytes it holds
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_bytes: int = 0
    # waiting requests by priority (every one is 0 under the fcfs policy)
    num_waiting_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    # LoRA (engine.adapters): the names of the adapters of running and waiting requests
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)


class OutputBatch(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    outputs: list[TokenDelta]
    stats: EngineStats


class EngineReady(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The engine's handshake once the model is loaded."""

    protocol_version: int
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    pooler: PoolerInfo | None = None  # the pooling runner's model (None: generate)


class PoolerInfo(msgspec.Struct, frozen=True, array_like=True):
    """What a front end needs to know of a pooling runner's model (``EngineReady``):
    its ``task`` (``"embed"`` or ``"score"``), the embedding's size, whether its
    ``dimensions`` may be cut (Matryoshka; ``matryoshka_dimensions``: the sizes it was
    trained at, if the checkpoint lists them) and the prompt prepended to text inputs
    (sentence-transformers' default prompt); ``keep_head``: truncation keeps an input's
    head (an encoder's, see ``cut``), not its tail."""

    task: PoolingTask
    size: int
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    prompt: str = ""
    keep_head: bool = False

    def cut(self, ids: list[int], keep: int) -> list[int]:
        """``truncate_prompt_tokens``: an input's last ``keep`` tokens (vLLM's, for a
        decoder, whose pooled token is the last), or for an encoder its first
        ``keep - 1`` and its last (the closing separator), as its tokenizer truncates
        on the right after the template's ``[CLS]`` (what sentence-transformers does
        past ``max_seq_length``)."""
        if len(ids) <= keep:
            return ids
        return ids[: keep - 1] + ids[-1:] if self.keep_head else ids[-keep:]


class EngineError(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The engine hit a fault it cannot recover from; it exits after sending this."""

    message: str


FromEngine = OutputBatch | EngineReady | EngineError


# ---------------------------------------------------------------------------------------
# process start-up


class EngineLaunch(msgspec.Struct, frozen=True):
    """What the front end hands the engine process (JSON on its command line): where the
    shared memory and doorbells are (inherited file descriptors) and how to run.

    ``config`` is an ``EngineConfig`` as a plain dict (decoded by the engine). There is
    one channel per front-end process (``front_bell_fds[i]`` wakes front end ``i``); each
    is two rings, front -> engine first, and the channels lie back to back in one mapping
    of ``shm_size`` bytes. All front ends wake the engine through ``engine_bell_fd``.
    """

    protocol_version: int
    config: dict[str, object]
    shm_fd: int
    shm_size: int
    ring_capacity: int
    engine_bell_fd: int
    front_bell_fds: list[int]
    parent_pipe_fd: int
    parent_pid: int
    spin_us: float = 50.0


# ---------------------------------------------------------------------------------------
# a front end <-> its response store process (server/store_process.py), length-prefixed
# msgpack frames over a Unix socket pair; rows carry their JSON as the front end encoded it


class StoreLaunch(msgspec.Struct, frozen=True):
    """What a front end hands its store process: the SQLite file and its bounds, and the
    inherited socket of each connection (writes, reads: one SQLite connection each)."""

    path: str
    max_bytes: int
    ttl: float
    parent_pid: int
    write_fd: int
    read_fd: int


class StoreRow(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One response to store: ``response``, ``conversation`` and ``events`` are JSON."""

    id: str
    status: str
    response: bytes
    conversation: bytes
    engine_request_id: str | None = None
    owner_pid: int | None = None
    events: bytes | None = None


class StoredRow(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A stored response as read (JSON as stored)."""

    response: bytes
    conversation: bytes
    engine_request_id: str | None
    cancel_requested: bool
    owner_pid: int | None
    events: bytes | None


class StorePut(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """Insert or replace each row, in one transaction, then evict."""

    rows: list[StoreRow]


class StoreGet(msgspec.Struct, frozen=True, tag=True, array_like=True):
    response_id: str


class StoreDelete(msgspec.Struct, frozen=True, tag=True, array_like=True):
    response_id: str


class StoreCancel(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Mark a background run as to be cancelled; the reply has its row as it is then."""

    response_id: str


StoreCall = StorePut | StoreGet | StoreDelete | StoreCancel


class StoreReply(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The answer to one ``StoreCall``. ``took_ns``: the call's time in the store process
    (``perf_counter_ns`` around the SQLite transaction); ``received_ns``, ``replied_ns``:
    when the store process had read the call and when it sent this (``perf_counter_ns``:
    CLOCK_MONOTONIC, one clock for every process of the machine); ``row``: a get's or a
    cancel's row; ``deleted``: a delete found the row; ``error``: the call failed."""

    took_ns: int
    row: StoredRow | None = None
    deleted: bool = False
    error: str | None = None
    received_ns: int = 0
    replied_ns: int = 0


# ---------------------------------------------------------------------------------------
# engine (rank 0) -> tensor-parallel workers, over the broadcast ring


class RowSampling(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One sampling row as the last pipeline stage samples it (``StepInput.last_stage_rows``,
    see ``engine.stage_sampling``). The last stage keeps, per request, its settings and
    (for penalties) its token ids, so a row carries only what changed:

    - ``step``: the row's output index (``num_output_tokens``, a verified chunk's drafts
      before the row included): a seeded draw's counter and ``min_tokens``' clock;
    - ``sampling``: the request's settings (without the front end's stop strings and
      grammar spec), with its first row on the last stage only;
    - ``new_tokens``: int32 token ids (prompt and output, in order) appended since the
      last stage last got the request's, for a request with penalties only;
    - ``drafts_before``: the drafts before this row of a verified chunk;
    - ``mask``: int32 ``[W]``, the grammar's allowed tokens (bit ``t % 32`` of word
      ``t // 32``), for a constrained row only: computed on rank 0, which owns the
      matchers, before the step goes out.
    """

    request_id: str
    step: int
    sampling: SamplingParams | None = None
    new_tokens: bytes = b""
    drafts_before: list[int] = []
    mask: bytes | None = None


class StepInput(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """One model step's inputs (the flat batch of ``engine.runner``), as every rank
    needs them. Integer arrays travel as raw bytes in native order (every rank is on
    this machine; a ``bytearray`` on decoding, so that ``torch.frombuffer`` can wrap it
    without a copy); the short per-sequence lists as msgpack integers.

    ``logit_rows`` are the rows whose logits are computed (and gathered to rank 0) after
    the forward pass, ``LOGIT_SLICE`` rows at a time (see ``engine.runner``): one per
    sampling sequence, then one per prompt position scored for ``prompt_logprobs``;
    empty when no sequence samples or scores in this step.

    ``last_stage_rows`` (pipeline parallelism): one per sampling row; the last stage
    samples them and sends rank 0 the token ids and the logprobs asked for (one float64
    message, ``engine.stage_sampling.pack``) instead of the float32 logits ``[N, V]``.
    ``released``: requests that ended, whose state the last stage drops (before this
    step's rows, which may reuse an id). ``rank0_samples``: the rows' settings or history
    did not all fit in this step (``engine.stage_sampling.StageFeed``): the last stage
    takes in what came and sends the logits, and rank 0 samples.
    """

    input_ids: bytearray  # int64 [T]
    positions: bytearray  # int64 [T]
    slot_mapping: bytearray  # int64 [T]
    block_tables: bytearray  # int32 [B, MB], row-major
    seq_lens: list[int]  # [B]
    query_start: list[int]  # [B+1]
    num_decodes: int
    logit_rows: list[int]
    last_stage_rows: list[RowSampling] | None = None
    released: list[str] = []
    rank0_samples: bool = False
    state_slots: list[int] = []  # [B] hybrid models: each sequence's recurrent-state slot
    # hybrid models' saved states (engine.state_cache): (saved row, slot) copied before
    # the step; (sequence, rows into its chunk, saved row) copied once those rows ran
    state_loads: list[tuple[int, int]] = []
    state_saves: list[tuple[int, int, int]] = []


class StopWorker(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Rank 0 is shutting down: exit the step loop."""


ToWorker = StepInput | StopWorker


class WorkerLaunch(msgspec.Struct, frozen=True):
    """What rank 0 hands a tensor-parallel worker (JSON on its command line): its rank,
    where the process group's store listens, and where the broadcast ring and doorbells
    are (inherited file descriptors). ``config`` is an ``EngineConfig`` as a plain dict.
    ``die_with_parent``: whether to set ``PR_SET_PDEATHSIG`` (only when the spawning
    thread is the main thread, since the signal follows the thread, see ``ipc.spawn``)."""

    protocol_version: int
    config: dict[str, object]
    rank: int
    world_size: int
    store_port: int
    shm_fd: int
    shm_size: int
    ring_capacity: int
    bell_fd: int
    writer_bell_fd: int
    parent_pipe_fd: int
    parent_pid: int
    die_with_parent: bool = True
    spin_us: float = 50.0
    # A rank on another host than rank 0 (``engine.node``): no ring (``shm_fd`` and the
    # doorbells are -1); it meets the store at ``master_addr`` and gets its steps over
    # TCP; its collectives bind to ``node_addr``.
    remote: bool = False
    master_addr: str = "127.0.0.1"
    node_addr: str = "127.0.0.1"
