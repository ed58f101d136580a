"""Every message that crosses a process boundary, and nothing else.

Rule of this module: plain data only (dataclasses of ints, floats, strings, lists, dicts, numpy arrays
or torch tensors, and other messages). No behaviour, no sockets, no device code. Each class has a
one-byte KIND that the codec writes ahead of the payload; decoding looks the class up in REGISTRY, never
by name. Adding a field changes the wire format: bump PROTOCOL_VERSION.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 5

REGISTRY: dict[int, type] = {}


def _message(kind: int):
    def wrap(cls):
        cls = dataclass(slots=True)(cls)
        if kind in REGISTRY:
            raise RuntimeError(f"duplicate message kind {kind}: {REGISTRY[kind].__name__}, {cls.__name__}")
        cls.KIND = kind
        REGISTRY[kind] = cls
        return cls

    return wrap


# --- membership and liveness (every process <-> coordinator) -------------------------------------


@_message(1)
class Hello:
    """First message of a participant to the coordinator (and of a worker to the scheduler)."""

    role: str  # gateway | scheduler | worker | trainer
    name: str  # unique member name, e.g. "worker-0"
    pid: int
    protocol_version: int
    info: dict[str, Any] = field(default_factory=dict)  # role-specific, e.g. a worker's KV capacity


@_message(2)
class Welcome:
    """Coordinator's answer to Hello: refused on a protocol mismatch, else the control snapshot.

    The snapshot is the state all commands up to `seq` produced (zguide "Clone"): a late or restarted
    member applies it, then only commands with a higher seq.
    """

    accepted: bool
    reason: str
    seq: int
    snapshot: dict[str, Any]


@_message(3)
class Heartbeat:
    name: str
    seq: int  # the sender's last applied control seq (coordinator: last published)


@_message(4)
class Ready:
    """A process finished start-up; sent to the launcher's ready socket when there is one."""

    role: str
    name: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


# --- acknowledged control broadcast --------------------------------------------------------------


@_message(10)
class ControlRequest:
    """Ask the coordinator to broadcast a command and collect every member's ack."""

    request_id: str
    command: str
    args: dict[str, Any]
    timeout_s: float


@_message(11)
class ControlReply:
    request_id: str
    ok: bool
    error: str
    seq: int
    results: dict[str, Any]  # member name -> what its ack returned
    missing: list[str] = field(default_factory=list)  # members that did not ack in time


@_message(12)
class Command:
    """A numbered broadcast. Members apply commands strictly in seq order and ack each one."""

    seq: int
    command: str
    args: dict[str, Any]


@_message(13)
class Ack:
    seq: int
    name: str
    ok: bool
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)


# --- requests (gateway <-> scheduler) ------------------------------------------------------------


@_message(20)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # engine.sampling_params.SamplingParams.to_wire()
    eos_token_ids: list[int]
    arrival_time: float


@_message(21)
class AbortRequests:
    request_ids: list[str]


@_message(22)
class RequestOutput:
    """New tokens of one request since its last output (a delta)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None  # per new token, when the request asked for logprobs
    top_logprobs: list[list[list[float]]] | None  # per new token: [[token_id, logprob], ...]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    stop_reason: int | None  # the stop token id that ended it, if any
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    weight_version: int  # epoch of the weights that computed these tokens (engine.control_state)
    stale_kv: bool = False  # computed on KV that older weights produced (a keep pause without clear_cache)
    ranks: list[int] | None = None  # per new token, its 1-based rank (with logprobs)
    sampling_mass: list[float] | None = None  # per new token (return_sampling_mass): mass the filters kept
    prompt_logprobs: PromptLogprobs | None = None  # on the first output only, when the request asked
    # MoE router capture (--enable-return-routed-experts): expert ids np.uint8/uint16 [n, num_moe_layers, top_k]
    # of positions routed_experts_start .. +n, computed since the last output. A recompute after preemption
    # sends positions again: later rows replace earlier ones of the same position. None: nothing new.
    routed_experts: Any = None
    routed_experts_start: int = 0


@_message(24)
class PromptLogprobs:
    """Logprobs of prompt tokens 1..P-1 (token 0 has none), computed from the raw logits of the position
    before each; rows in prompt order. Travels in StepResult (worker -> scheduler) and RequestOutput."""

    seq_id: str
    logprobs: Any  # np.float32 [P-1], of the prompt token itself
    ranks: Any  # np.int64 [P-1], 1-based
    topk_ids: Any  # np.int64 [P-1, K]
    topk_logprobs: Any  # np.float32 [P-1, K]


@_message(23)
class OutputBatch:
    """Everything one gateway gets from one scheduler step, plus the scheduler's gauges."""

    outputs: list[RequestOutput]
    stats: dict[str, float]


# --- step execution (scheduler <-> workers) ------------------------------------------------------


@_message(30)
class NewSeq:
    """A sequence the workers have not seen: sent once, in full."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    eos_token_ids: list[int]  # masked until min_tokens is reached


@_message(31)
class StepPlan:
    """One forward step. Running sequences travel as deltas: workers remember each sequence's tokens
    (prompt + what they sampled), so a scheduled sequence is (id, tokens already in KV, tokens to
    compute now, its block table). A sequence is sampled when the step reaches its last known token."""

    step_id: int
    new_seqs: list[NewSeq]
    seq_ids: list[str]  # decodes first, then prefill chunks
    num_computed: list[int]
    num_new: list[int]
    block_tables: list[list[int]]
    finished: list[str]  # forget these (finished, aborted or preempted-and-dropped)
    weight_version: int


@_message(32)
class StepResult:
    step_id: int
    rank: int
    seq_ids: list[str]  # the sampled sequences, in plan order
    token_ids: Any  # np.int64 [S]
    logprobs: Any  # np.float32 [S]
    topk_ids: Any  # np.int64 [S, K] (K = 0 when nobody asked)
    topk_logprobs: Any  # np.float32 [S, K]
    weight_version: int
    error: str = ""
    step_time_s: float = 0.0
    ranks: Any = None  # np.int64 [S]: rank of each sampled token (1-based; zeros when nobody asked)
    sampling_mass: Any = None  # np.float32 [S]: kept probability mass (1.0 where nothing was filtered)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # for sequences sampled the first time
    # --enable-return-routed-experts on an MoE model (rank 0 only): expert ids np.uint8/uint16 [R, layers, top_k]
    # and which rows are whose: [[seq_id, first position, first row, rows], ...]. Rows are this step's tokens
    # in plan order; positions a prefix-cache hit skipped are appended after them (read from the worker's
    # per-KV-slot copy), so every position of a sequence is reported once it is in the KV cache.
    routed_experts: Any = None
    routed_spans: list[list[Any]] | None = None


def message_kinds() -> dict[int, str]:
    return {k: c.__name__ for k, c in REGISTRY.items()}



# --- weight sync over the bus (trainer <-> coordinator) -------------------------------------------


@_message(40)
class WeightUpdateEvent:
    """A trainer announces a new weight version (DEALER -> coordinator's control ROUTER). The coordinator
    drives pause -> start_weight_update -> update_weights (one per entry of `updates`) ->
    finish_weight_update -> commit -> resume, each step acked by every worker, then replies with a
    WeightUpdateResult and publishes WeightVersionCommitted. For the collective backend the trainer
    broadcasts the tensors while the workers receive them (after sending this event)."""

    request_id: str
    version: str  # the label the committed weights get ("" keeps the current label)
    pause_mode: str  # abort | wait | keep | none; "" takes the server's weight-transfer-config pause_mode
    clear_cache: bool
    updates: list[dict[str, Any]]  # update_info of each update_weights call (vLLM's fields)
    timeout_s: float


@_message(41)
class WeightUpdateResult:
    request_id: str
    ok: bool
    error: str
    status: int  # the HTTP status the same failure would get (200 when ok)
    version: str
    weight_epoch: int
    timings_s: dict[str, float] = field(default_factory=dict)  # per step


@_message(42)
class WeightVersionCommitted:
    """Published on the commands XPUB (topic WEIGHTS_TOPIC) whenever a weight update commits, whoever
    drove it (HTTP or bus): every worker has the new weights in service."""

    version: str
    weight_epoch: int
    committed_at: float  # unix time
