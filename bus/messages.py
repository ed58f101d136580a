"""Every message and every command that crosses a process boundary, and nothing else.

Rules of this module: typed msgspec Structs only (ints, floats, strings, lists, dicts, numpy arrays
annotated `np.ndarray`, and other structs of this module). No behaviour, no sockets, no device code.

- A top-level message has a one-byte KIND (`@message(k)`) that the codec writes ahead of the body;
  decoding looks the class up by that byte, never by name. Structs nested inside others need no kind.
- Every struct is array-like (fields travel in declaration order, no names on the wire) and forbids
  unknown fields: an extra, missing (without a default) or wrongly typed field is a decode error.
- Commands (what the coordinator broadcasts, numbered, in `Command`) are one struct per command,
  subclasses of CommandBody, tagged with their snake_case name; `Command.body` is their tagged union.

Adding a command (the whole change, three places):
  1. here: `class ResetPrefixCache(CommandBody): reset_running_requests: bool = False` (fields typed);
  2. if it changes the control state: a reducer in bus/control_state.py's REDUCERS;
  3. a handler in each actor that acts on it: `handlers[ResetPrefixCache] = self._reset_prefix_cache`
     (a member with no handler acks it with an empty result); the sender builds the struct:
     `await client.control(ResetPrefixCache(), timeout_s=...)`.
  Then run tests/test_codec.py: its fingerprint test prints the new PROTOCOL_FINGERPRINT; bump
  PROTOCOL_VERSION and record both.

Protocol version: PROTOCOL_FINGERPRINT is a hash of every struct definition below (names, tags, field
names, types and defaults); tests/test_codec.py fails when the definitions change and the recorded pair
(version, fingerprint) does not. Hello carries both; the coordinator refuses a member whose pair differs.
"""

from __future__ import annotations

import enum
import hashlib
import re
import types
import typing
from typing import Annotated, Any, ClassVar, Union

import msgspec
import numpy as np

from bus.sampling_params import SamplingParams

# Bump with every change of any struct here (or of SamplingParams), and record the new fingerprint.
PROTOCOL_VERSION = 14  # 13 landed last; this round: layer-group tables, state checkpoints, LoRA push
PROTOCOL_FINGERPRINT = "8f3b9f5c218d"  # checked by tests/test_codec.py against protocol_fingerprint()

REGISTRY: dict[int, type] = {}


class Wire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Base of every bus struct: positional on the wire, strict on decode."""


def message(kind: int):
    def wrap(cls):
        if kind in REGISTRY:
            raise RuntimeError(f"duplicate message kind {kind}: {REGISTRY[kind].__name__}, {cls.__name__}")
        cls.KIND = kind
        REGISTRY[kind] = cls
        return cls

    return wrap


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# --- errors ----------------------------------------------------------------------------------------


class ErrorKind(str, enum.Enum):
    """The failures the engine names itself (ErrorInfo.kind); any other failure travels under its exception's
    class name. Receivers compare kinds, never message text."""

    __str__ = str.__str__  # "Asleep", not "ErrorKind.ASLEEP", in f-strings and logs
    __format__ = str.__format__

    # a start_weight_update the coordinator refused without broadcasting it, because an update is active:
    # the one error after which a caller must not abort (the active update is not its own)
    UPDATE_ACTIVE = "UpdateActive"
    TP_PEER = "TensorParallelPeer"  # a tp rank that could run a step another rank of its group could not
    ASLEEP = "Asleep"  # a plan reached a worker whose memory a sleep released
    WEIGHT_VERSION_LOST = "WeightVersionLost"  # the worker could not restore the version in service
    WEIGHTS_DISCARDED = "WeightsDiscarded"  # a level-2 sleep discarded weights not loaded again
    UNKNOWN_SEQUENCE = "UnknownSequence"  # a plan names sequences the worker dropped (a stall, a new scheduler)
    WORKER_LOST = "WorkerLost"
    SCHEDULER_LOST = "SchedulerLost"
    STEP_FAILED = "StepFailed"  # a worker step raised something it did not anticipate
    DUPLICATE_REQUEST = "DuplicateRequest"  # an AddRequest whose id is running already
    PAUSED = "Paused"  # an AddRequest while paused (abort mode)
    PROMPT_TOO_LONG = "PromptTooLong"
    GRAMMAR_ERROR = "GrammarError"  # a structured-output constraint the worker cannot compile
    GRAMMAR_REJECTED = "GrammarRejected"  # a forced (trace) token the request's constraint does not allow
    ENGINE_DEAD = "EngineDead"  # the gateway lost the engine
    UNFINISHED = "Unfinished"  # the engine ended a request without finishing it
    SHUTTING_DOWN = "ShuttingDown"
    TIMEOUT = "Timeout"
    CODEC = "CodecError"  # a handler returned something the bus cannot carry
    BAD_RESULT = "TypeError"  # a handler returned something its command does not declare
    UNKNOWN = "Error"  # a failed ack that said nothing


class ErrorInfo(Wire):
    """A failure as it travels: what kind, what it says, who raised it, and what it concerns."""

    kind: str  # an ErrorKind, or the exception class (e.g. "WeightSyncError")
    message: str
    member: str = ""  # the member that failed ("" when the coordinator itself reports it)
    status: int | None = None  # the HTTP status the failure maps to, when the raiser knew it
    param: str | None = None  # the request field concerned, when known
    tensor: str | None = None  # the tensor concerned, when known

    def text(self) -> str:
        """"worker-0: RuntimeError: boom". An error that knows its HTTP status (a WeightSyncError) is one
        the engine anticipated: its message is written for the caller and goes without the kind."""
        what = self.message if self.status is not None else f"{self.kind}: {self.message}"
        return f"{self.member}: {what}" if self.member else what


UPDATE_ACTIVE = ErrorKind.UPDATE_ACTIVE  # the name the weight-sync routes import


# --- weight-transfer payloads: vLLM's init_info / update_info, one struct per backend ------------------
# Maps on the wire (vLLM's field names), tagged with the backend ("backend" is never a field of vLLM's). The
# edges decode a trainer's JSON into them and refuse what does not fit (engine/weights/wire.py): the
# gateway's routes and, for WeightUpdateEvent, the coordinator; a worker checks them only against its model.

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's defaults
DEFAULT_PACKED_NUM_BUFFERS = 2
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
_HandleValue = Union[str, int, bool, None, list[int]]
# A plain-data IPC handle (engine/weights/ipc.py: its fields, or {device_key: handle}); the codec reads it.
IpcHandle = dict[str, Union[_HandleValue, dict[str, _HandleValue]]]


class TransferPayload(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, tag_field="backend"):
    """Base of init_info / update_info: the tag names the backend (engine.weights.backends' canonical names)."""

    REUSES_LAST: ClassVar[bool] = False  # update_info: all three lists empty means "the last call's tensors"


class IpcInitInfo(TransferPayload, tag="ipc"):
    """vLLM's IPCWeightTransferInitInfo (packed), with rollbus's timeout_s; no rendezvous."""

    packed: bool = False
    packed_buffer_size_bytes: Positive = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: Positive = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: Seconds | None = None  # rollbus's: the deadline of this call


class CollectiveInitInfo(TransferPayload, tag="hccl"):
    """vLLM's NCCLWeightTransferInitInfo: master_address + master_port (a StatelessProcessGroup rendezvous) or
    nccl_unique_id_b64 (a torch-free trainer's NCCL id), with rollbus's timeout_s."""

    world_size: NonNegative
    rank_offset: NonNegative = 1
    master_address: str | None = None
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: Positive = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: Positive = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: Seconds | None = None


class IpcUpdateInfo(TransferPayload, tag="ipc"):
    """vLLM's IPCWeightTransferUpdateInfo: the tensors, and handles to their bytes (rollbus's plain-data
    handles, or vLLM's pickled ones behind VLLM_ALLOW_INSECURE_SERIALIZATION)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[NonNegative]]
    ipc_handles: Union[list[IpcHandle], IpcHandle, None] = None  # one per tensor, or one (packed)
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[NonNegative] | None = None  # packed: bytes of each tensor


class CollectiveUpdateInfo(TransferPayload, tag="hccl"):
    """vLLM's NCCLWeightTransferUpdateInfo; the packing fields (vLLM before 0.33 sent them here; TRL still
    does) override init_info's for this call. All three lists empty: vLLM 0.33's "the same tensors as the
    last call"."""

    REUSES_LAST: ClassVar[bool] = True

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[NonNegative]]
    packed: bool | None = None
    packed_buffer_size_bytes: Positive | None = None
    packed_num_buffers: Positive | None = None


class RefusedUpdate(TransferPayload, tag="refused"):
    """An update_info the edge refused, sent on so each worker ends the call as it would have: with the
    collective backend the trainer is broadcasting its tensors meanwhile, so a worker takes part in them and
    drops the bytes (`wire`: what could be read of their sizes), or tears the group down when nothing could
    (None); then it fails the call with `message`, a 400 naming `param`."""

    message: str
    param: str
    wire: CollectiveUpdateInfo | None = None


InitInfo = Union[IpcInitInfo, CollectiveInitInfo]
UpdateInfo = Union[IpcUpdateInfo, CollectiveUpdateInfo, RefusedUpdate]


# --- what members report about themselves (Hello.info, Ready.info, the Members reply) ------------------
# Maps on the wire, not arrays (rare and small messages), so /server_info shows them as JSON as they are.


class Layout(msgspec.Struct, forbid_unknown_fields=True):
    """What every engine process must agree on (engine.topology.layout): the coordinator refuses a member
    whose layout differs from its own (another host started with other flags)."""

    model: str
    tensor_parallel_size: int
    data_parallel_size: int
    max_model_len: int | None
    block_size: int
    dtype: str
    kv_cache_dtype: str


class RoleInfo(msgspec.Struct, forbid_unknown_fields=True, tag=_snake):
    """Base of the per-role reports; the tag (snake_case class name) says which."""


class SchedulerInfo(RoleInfo):
    layout: Layout


class WorkerInfo(RoleInfo):
    """A worker's report of itself (workers.startup): its Hello, /server_info's `workers`."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    device: str
    model: str
    tensor_parallel_size: int
    tp_rank: int
    weight_bytes: int
    dtype: str  # what weight updates must send
    kv_cache_bytes: int
    kv_cache_dtype: str
    kernels: str
    attention: str
    batch_invariant_checked: list[str]
    cpu_linear: str | None
    host_allocator: str | None
    warm_up_s: float
    host_huge_pages: str | None
    cpu_threads: dict[str, int | None] | None
    layout: Layout
    worker_extension_methods: list[str] = []  # --worker-extension-cls (workers.extension)
    joined_seq: int = 0  # in its Hello to the scheduler: the seq it (re)joined the bus at
    state_slots: int = 0  # a hybrid model's recurrent-state slots (workers.kv_cache); 0: attention only
    state_checkpoints: int = 0  # a hybrid model's checkpoint slots for prefix caching (0: prefix caching off)
    kv_window: int = 0  # the sliding window whose blocks are freed: every attention layer's, or window_blocks' group's
    # a model whose layers mix windows: the blocks of its sliding-window layers' own pool (engine.window_blocks;
    # StepPlan.window_tables); num_blocks is then the full-attention layers'. 0: one pool for every layer
    window_blocks: int = 0


class SchedulerReady(RoleInfo):
    """What a scheduler found at start-up (Ready.info): the KV capacity its workers reported."""

    num_blocks: int
    max_model_len: int
    async_scheduling: bool


class GatewayReady(RoleInfo):
    """Where a gateway serves HTTP (Ready.info)."""

    url: str


# --- command results (what a member's Ack carries back) ---------------------------------------------


class CommandResult(Wire, tag=_snake):
    """Base of every ack result. Each command names the results its members may return (`RESULTS`): the
    follower fails an ack whose handler returned anything else, and Ack / ControlReply carry the tagged
    union AnyResult, so a receiver reads fields, never string keys. A member with nothing to say acks None."""


class WeightsStatus(Wire):
    """How many parameters a level-2 sleep left without content (-1: all of them), of how many: the acks
    of commands that can change it carry it, and the coordinator turns a change into WeightsMissing."""

    missing: int
    total: int


class HealthReport(CommandResult):
    ok: bool
    why: str = ""  # when not ok
    running: int | None = None  # the scheduler's running requests


class NotStarted(CommandResult):
    """The scheduler is still waiting for its workers: it builds its state from the snapshot then."""


class Quiesced(CommandResult):
    """The scheduler stopped stepping for a pause, a sleep or a weight update (no step in flight)."""

    aborted: int = 0  # requests an abort-mode quiesce ended
    kv_blocks: list[int] | None = None  # a sleep with offload_kv: the KV blocks the kept requests hold


class AlreadyQuiet(CommandResult):
    """A pause, a sleep or a weight update's window held steps already: nothing to quiesce."""


class Resumed(CommandResult):
    pass


class SleepingTags(CommandResult):
    tags: list[str]  # what still sleeps after a wake_up


class WeightEpoch(CommandResult):
    epoch: int  # the scheduler's weight epoch after the command


class MemoryReleased(CommandResult):
    released_bytes: int
    released_group: bool  # the weight-transfer group too (sleep_mode_extra_cleanup)
    weights: WeightsStatus | None = None
    lora_dropped: list[str] = []  # level 2: adapters a trainer pushed, whose tensors went (push them again)


class WokeUp(CommandResult):
    restored_bytes: int
    weights: WeightsStatus | None = None


class TransferReady(CommandResult):
    backend: str
    packed: bool


class UpdateStarted(CommandResult):
    pass


class WeightsReceived(CommandResult):
    tensors: int
    bytes: int


class UpdateFinished(CommandResult):
    tensors: int


class UpdateCommitted(CommandResult):
    committed: bool  # False: nothing was staged
    tensors: int = 0
    parameters: int = 0
    weights: WeightsStatus | None = None


class UpdateAborted(CommandResult):
    aborted: bool  # an update was active
    in_place: bool  # it wrote into the weights in service (stage_updates off)


class TransferShutDown(CommandResult):
    pass


class Checksums(CommandResult):
    checksums: dict[str, str]  # "dp0:pp0:pcp0:tp0:<tensor>" -> sha256 hex, the checkpoint's names
    weights: WeightsStatus | None = None
    stacked: dict[str, str] = {}  # MoE experts stacked as transformers 5 holds them (a compare accepts these too)


class WeightsZeroed(CommandResult):
    """/weight_checker reset (vLLM's zero_weights): every parameter zeroed, none served until an update."""

    zeroed: int  # parameters zeroed on this worker
    weights: WeightsStatus | None = None


class PrefixCacheReset(CommandResult):
    success: bool


class WeightsReloaded(CommandResult):
    loaded_tensors: int
    weights: WeightsStatus | None = None


class ExtensionReturned(CommandResult):
    value: Any  # what the --worker-extension-cls method returned (bus-encodable values, host tensors)
    weights: WeightsStatus | None = None


class WeightsShared(CommandResult):
    path: str


class MemberEntry(CommandResult):
    """One member in the coordinator's answer to Members."""

    role: str
    pid: int
    info: Union[SchedulerInfo, WorkerInfo, None] = None


AnyResult = Union[HealthReport, NotStarted, Quiesced, AlreadyQuiet, Resumed, SleepingTags, WeightEpoch,
                  MemoryReleased, WokeUp, TransferReady, UpdateStarted, WeightsReceived, UpdateFinished,
                  UpdateCommitted, UpdateAborted, TransferShutDown, Checksums, WeightsZeroed, PrefixCacheReset,
                  WeightsReloaded, ExtensionReturned, WeightsShared, MemberEntry, None]

_QUIET = (Quiesced, AlreadyQuiet, NotStarted)  # the scheduler's answers to a command that quiesces


# --- commands (numbered broadcasts; see the module docstring for how to add one) -------------------


class CommandBody(Wire, tag=_snake):
    """Base of every command. The tag (the snake_case class name) is the command's name; RESULTS are the
    result structs its members may ack it with (empty: they ack None)."""

    RESULTS: ClassVar[tuple[type, ...]] = ()


class Health(CommandBody):
    RESULTS = (HealthReport,)


class Shutdown(CommandBody):
    pass


class Members(CommandBody):
    """Read-only: the coordinator answers with its member list, nothing is broadcast."""

    RESULTS = (MemberEntry,)


class MemberLost(CommandBody):
    name: str
    role: str
    why: str


class MemberJoined(CommandBody):
    """A member was welcomed (first start, restart, or a lost member back after a stall): published by
    the coordinator right after its Welcome, so every member sees joins and losses in one order."""

    name: str
    role: str
    pid: int = 0


class ShareWeights(CommandBody):
    """A restarted worker asks a live peer (`donor`) for the weight version in service: the donor writes a
    tagged copy to `path` (same host) and acks {"path": path}; everyone else acks with nothing."""

    member: str = ""  # who asks
    donor: str = ""
    path: str = ""

    RESULTS = (WeightsShared,)


class WeightsLost(CommandBody):
    """A worker cannot hold the weight version in service (it restarted after an update and no copy of
    that version was left to load): requests are refused (503 naming the version) until a weight update
    commits on every worker. The coordinator also publishes WeightVersionLost on topic W for trainers."""

    version: str = ""
    epoch: int = 0
    member: str = ""
    why: str = ""


class Pause(CommandBody):
    mode: str  # abort | wait | keep
    clear_cache: bool = True

    RESULTS = _QUIET


class Resume(CommandBody):
    RESULTS = (Resumed, NotStarted)


class Sleep(CommandBody):
    """First phase of /sleep: every member quiesces (the scheduler acks once no step runs)."""

    level: int  # 0: scheduling only; 1: weights offloaded; 2: weights discarded
    mode: str = "abort"
    # the KV of kept (frozen) requests survives: the workers offload it to the host and restore it on wake
    # (SkyRL's sleep_for_weight_sync); without it, from level 1 the kept requests drop their KV (recomputed)
    offload_kv: bool = False

    RESULTS = _QUIET


class ReleaseMemory(CommandBody):
    """Second phase of /sleep: the workers release device memory."""

    level: int
    offload_kv: bool = False
    # with offload_kv: per scheduler name, the KV blocks its kept requests hold (the scheduler's Sleep ack),
    # which its workers copy to the host before releasing the cache
    kv_blocks: dict[str, list[int]] = {}

    RESULTS = (MemoryReleased,)


class WakeUp(CommandBody):
    tags: list[str] | None = None  # None: every tag

    RESULTS = (SleepingTags, WokeUp, NotStarted)


class UpdateWeightVersion(CommandBody):
    new_version: str

    RESULTS = (WeightEpoch, NotStarted)


class InitWeightTransferEngine(CommandBody):
    init_info: InitInfo

    RESULTS = (TransferReady,)


class StartWeightUpdate(CommandBody):
    RESULTS = (*_QUIET, UpdateStarted)


class UpdateWeights(CommandBody):
    update_info: Union[UpdateInfo, list[UpdateInfo]]  # one for every worker, or one per worker rank

    RESULTS = (WeightsReceived,)


class FinishWeightUpdate(CommandBody):
    RESULTS = (UpdateFinished,)


class CommitWeightUpdate(CommandBody):
    new_version: str = ""  # "" keeps the current label

    RESULTS = (WeightEpoch, NotStarted, UpdateCommitted)


class AbortWeightUpdate(CommandBody):
    RESULTS = (WeightEpoch, NotStarted, UpdateAborted)


class ShutdownWeightTransferEngine(CommandBody):
    RESULTS = (TransferShutDown,)


class WeightChecker(CommandBody):
    action: str = "checksum"

    RESULTS = (Checksums, WeightsZeroed)


class ResetPrefixCache(CommandBody):
    """vLLM's /reset_prefix_cache: the scheduler forgets every cached prefix (acks PrefixCacheReset)."""

    reset_running_requests: bool = False

    RESULTS = (PrefixCacheReset,)


class WeightsMissing(CommandBody):
    """How many parameters a level-2 sleep discarded are still not loaded again (the coordinator publishes
    it from the workers' acks); requests are refused while it is not 0 (-1: all of them)."""

    count: int
    total: int = 0


class ReloadWeightsCall(Wire, tag="reload_weights"):
    weights_path: str | None = None  # a model folder; None: the one the engine started from


class ExtensionCall(Wire, tag="extension"):
    """A --worker-extension-cls method's arguments: JSON values, as the client's /collective_rpc body held
    them, carried as that JSON text and decoded by the worker (they are the extension's, not the bus's)."""

    args_json: str = "[]"
    kwargs_json: str = "{}"


class LoraTargetCall(Wire, tag="lora_target"):
    """SkyRL's skyrl_set_lora_receive_target (version > 0: the next weight update builds this adapter version
    from its tensors instead of writing the model; checked by the gateway, engine.lora) and
    skyrl_discard_in_memory_lora (version 0: drop the pushed tensors kept for that adapter id)."""

    lora_name: str
    lora_id: int
    version: int = 0
    rank: int = 0
    scaling: float = 0.0
    aliases: dict[str, str] = msgspec.field(default_factory=dict)  # public PEFT name -> the sent name it shares
    # expert LoRA: each targeted stacked expert parameter (gate_up_proj, down_proj) -> (its rank, its scaling)
    experts: dict[str, tuple[int, float]] = msgspec.field(default_factory=dict)


class CollectiveRpc(CommandBody):
    method: str
    call: Union[ReloadWeightsCall, ExtensionCall, LoraTargetCall] = msgspec.field(default_factory=ReloadWeightsCall)

    RESULTS = (WeightsReloaded, ExtensionReturned)


AnyCommand = Union[Health, Shutdown, Members, MemberLost, Pause, Resume, Sleep, ReleaseMemory, WakeUp,
                   UpdateWeightVersion, InitWeightTransferEngine, StartWeightUpdate, UpdateWeights,
                   FinishWeightUpdate, CommitWeightUpdate, AbortWeightUpdate, ShutdownWeightTransferEngine,
                   WeightChecker, CollectiveRpc, ResetPrefixCache, WeightsMissing, MemberJoined, WeightsLost,
                   ShareWeights]


def command_name(body: CommandBody) -> str:
    return type(body).__struct_config__.tag


# --- the control state (what commands leave behind; the Welcome snapshot) --------------------------


class PauseState(msgspec.Struct, forbid_unknown_fields=True):
    mode: str  # abort | wait | keep
    clear_cache: bool


class LostMember(msgspec.Struct, forbid_unknown_fields=True):
    role: str  # scheduler | worker
    why: str


class ControlState(msgspec.Struct, forbid_unknown_fields=True):
    """The engine's control state; bus.control_state holds how each command changes it. A map on the
    wire (a snapshot is rare and small), so /server_info can show it as JSON as it is."""

    paused: PauseState | None = None
    sleep_level: int | None = None  # None when awake, else the level of the sleep in force
    sleeping_tags: list[str] = []  # level 0: ["scheduling"]; levels 1 and 2: ["weights", "kv_cache"]
    # Weight versions are free-form labels (vLLM); the engine numbers them with an epoch that travels
    # in every StepPlan/StepResult/RequestOutput and keys the prefix cache.
    weight_version: str = "default"
    weight_epoch: int = 0
    version_labels: dict[str, str] = msgspec.field(default_factory=lambda: {"0": "default"})
    # Between start_weight_update and its commit or abort: the scheduler holds steps meanwhile.
    weight_update_active: bool = False
    # After a level-2 sleep: parameters not loaded again (-1: all; WeightsMissing), of weights_total.
    weights_missing: int = 0
    weights_total: int = 0
    # Recovery (docs/architecture.md "Liveness and recovery"): the engine's processes declared lost and not
    # back yet (scheduler and workers only), how many weight updates committed since the start (0: the
    # checkpoint is the version in service), the version a restarted worker could not restore (requests
    # 503 until an update commits), and this run's id (tags the workers' recovery copies of the weights).
    lost: dict[str, LostMember] = {}
    weight_commits: int = 0
    weights_lost: str | None = None
    run_id: str = ""


# --- membership and liveness (every process <-> coordinator) -------------------------------------


@message(1)
class Hello(Wire):
    """First message of a participant to the coordinator (and of a worker to the scheduler)."""

    role: str  # gateway | scheduler | worker | trainer
    name: str  # unique member name, e.g. "worker-0"
    pid: int
    protocol_version: int
    info: Union[SchedulerInfo, WorkerInfo, None] = None  # per role (gateways and trainers: None)
    protocol_fingerprint: str = ""  # bus.messages.PROTOCOL_FINGERPRINT of the sender


class HelloPreamble(msgspec.Struct, array_like=True):
    """The fields of a Hello that every protocol version shares, in order, and its fingerprint (what follows
    them is ignored): how the coordinator reads an old or newer peer's Hello whose body no longer decodes, to
    refuse it naming both versions (bus.codec.decode)."""

    role: str
    name: str
    pid: int
    protocol_version: int
    info: Any = None
    protocol_fingerprint: str = ""


@message(2)
class Welcome(Wire):
    """Coordinator's answer to Hello: refused on a protocol mismatch, else the control snapshot.

    The snapshot is the state all commands up to `seq` produced (zguide "Clone"): a late or restarted
    member applies it, then only commands with a higher seq.
    """

    accepted: bool
    reason: str
    seq: int
    snapshot: ControlState


@message(3)
class Heartbeat(Wire):
    name: str
    seq: int  # the sender's last applied control seq (coordinator: last published)


@message(4)
class Ready(Wire):
    """A process finished start-up; sent to the launcher's ready socket when there is one."""

    role: str
    name: str
    pid: int
    info: Union[WorkerInfo, SchedulerReady, GatewayReady, None] = None


# --- acknowledged control broadcast --------------------------------------------------------------


@message(10)
class ControlRequest(Wire):
    """Ask the coordinator to broadcast a command and collect every member's ack."""

    request_id: str
    body: AnyCommand
    timeout_s: float


@message(11)
class ControlReply(Wire):
    request_id: str
    ok: bool
    seq: int
    results: dict[str, AnyResult]  # member name -> what its ack returned
    errors: list[ErrorInfo] = []  # one per failing member
    missing: list[str] = []  # members that did not ack in time

    @property
    def error(self) -> str:
        """Human-readable: each failure, then who did not ack."""
        return describe(self.errors, self.missing)


def describe(errors: list[ErrorInfo], missing: list[str]) -> str:
    parts = [e.text() for e in errors]
    if missing:
        parts.append(f"no ack from {', '.join(sorted(missing))}")
    return "; ".join(parts)


@message(12)
class Command(Wire):
    """A numbered broadcast. Members apply commands strictly in seq order and ack each one."""

    seq: int
    body: AnyCommand


@message(13)
class Ack(Wire):
    seq: int
    name: str
    ok: bool
    error: ErrorInfo | None = None
    result: AnyResult = None  # one of the command's RESULTS, or None


# --- requests (gateway <-> scheduler) ------------------------------------------------------------


@message(20)
class AddRequest(Wire):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float


@message(21)
class AbortRequests(Wire):
    request_ids: list[str]


@message(24)
class PromptLogprobs(Wire):
    """Logprobs of prompt tokens 1..P-1 (token 0 has none), computed from the raw logits of the position
    before each; rows in prompt order. Travels in StepResult (worker -> scheduler) and RequestOutput."""

    seq_id: str
    logprobs: np.ndarray  # np.float32 [P-1], of the prompt token itself
    ranks: np.ndarray  # np.int64 [P-1], 1-based
    topk_ids: np.ndarray  # np.int64 [P-1, K]
    topk_logprobs: np.ndarray  # np.float32 [P-1, K]


@message(22)
class RequestOutput(Wire):
    """New tokens of one request since its last output (a delta)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None  # per new token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # per new token: [(token_id, logprob), ...]
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    stop_reason: int | None  # the stop token id that ended it, if any
    error: ErrorInfo | None  # with finish_reason "error": why (its status when the engine knows the HTTP one)
    num_prompt_tokens: int
    num_cached_tokens: int
    weight_epoch: int  # the epoch of the weights that computed these tokens (ControlState.weight_epoch)
    stale_kv: bool = False  # computed on KV that older weights produced (a keep pause without clear_cache)
    ranks: list[int] | None = None  # per new token, its 1-based rank (with logprobs)
    sampling_mass: list[float] | None = None  # per new token (return_sampling_mass): mass the filters kept
    prompt_logprobs: PromptLogprobs | None = None  # on the first output only, when the request asked
    # --return-sampling-mask: per new token the ids the sampler could draw, compact (engine/sampling_mask.py):
    # np.int32 ids one row after another, and per token a count (c >= 0: c kept ids; -d-1: all but d ids)
    sampling_mask_ids: np.ndarray | None = None
    sampling_mask_counts: np.ndarray | None = None
    # MoE router capture (--enable-return-routed-experts): expert ids np.uint8/uint16 [n, num_moe_layers, top_k]
    # of positions routed_experts_start .. +n, computed since the last output. A recompute after preemption
    # sends positions again: later rows replace earlier ones of the same position. None: nothing new.
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0


@message(23)
class OutputBatch(Wire):
    """Everything one gateway gets from one scheduler step, plus the scheduler's gauges."""

    outputs: list[RequestOutput]
    stats: dict[str, Union[int, float]]


# --- step execution (scheduler <-> workers) ------------------------------------------------------


@message(30)
class NewSeq(Wire):
    """A sequence the workers have not seen: sent once, in full."""

    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int]  # masked until min_tokens is reached


@message(31)
class StepPlan(Wire):
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
    weight_epoch: int  # the epoch of the weights in service (ControlState.weight_epoch; its label: weight_version)
    state_slots: list[int] = []  # hybrid models: each sequence's recurrent-state slot, as seq_ids (else empty)
    # mixed-window models (WorkerInfo.window_blocks): each sequence's sliding-window layers' table, as seq_ids,
    # FREED (-1) before the window (else empty); block_tables are then the full-attention layers'
    window_tables: list[list[int]] = []
    # hybrid models with prefix caching (engine.state_checkpoints): [state slot, checkpoint] pairs, the
    # checkpoint restored into the slot before the step (a prefix hit), or the slot saved into it after
    state_loads: list[tuple[int, int]] = []
    state_saves: list[tuple[int, int]] = []


@message(32)
class StepResult(Wire):
    step_id: int
    rank: int
    seq_ids: list[str]  # the sampled sequences, in plan order
    token_ids: np.ndarray | None  # np.int64 [S] (None in a failed or interrupted step)
    logprobs: np.ndarray | None  # np.float32 [S]
    topk_ids: np.ndarray | None  # np.int64 [S, K] (K = 0 when nobody asked)
    topk_logprobs: np.ndarray | None  # np.float32 [S, K]
    weight_epoch: int
    error: ErrorInfo | None = None  # the step failed on this rank (nothing sampled)
    step_time_s: float = 0.0
    ranks: np.ndarray | None = None  # np.int64 [S]: rank of each sampled token (1-based; zeros when nobody asked)
    sampling_mass: np.ndarray | None = None  # np.float32 [S]: kept probability mass (1.0 where nothing was filtered)
    prompt_logprobs: list[PromptLogprobs] = []  # for sequences sampled the first time
    # --enable-return-routed-experts on an MoE model (rank 0 only): expert ids np.uint8/uint16 [R, layers, top_k]
    # and which rows are whose: [[seq_id, first position, first row, rows], ...]. Rows are this step's tokens
    # in plan order; positions a prefix-cache hit skipped are appended after them (read from the worker's
    # per-KV-slot copy), so every position of a sequence is reported once it is in the KV cache.
    routed_experts: np.ndarray | None = None
    routed_spans: list[tuple[str, int, int, int]] | None = None
    interrupted: bool = False  # an abort pause cut the step short: nothing was computed, nothing failed
    # sequences that failed alone (the rest of the step is fine): a structured-output constraint the worker
    # cannot enforce, or a forced token its grammar rejects; the scheduler fails just these requests
    seq_errors: list[tuple[str, ErrorInfo]] = []
    # --return-sampling-mask (rank 0): each sampled row's support, compact (engine/sampling_mask.py):
    # np.int32 ids of every row one after another, np.int32 [S] counts
    sampling_mask_ids: np.ndarray | None = None
    sampling_mask_counts: np.ndarray | None = None


# --- weight sync over the bus (trainer <-> coordinator) -------------------------------------------


@message(40)
class WeightUpdateEvent(Wire):
    """A trainer announces a new weight version (DEALER -> coordinator's control ROUTER). The coordinator
    drives pause -> start_weight_update -> update_weights (one per entry of `updates`) ->
    finish_weight_update -> commit -> resume, each step acked by every worker, then replies with a
    WeightUpdateResult and publishes WeightVersionCommitted. For the collective backend the trainer
    broadcasts the tensors while the workers receive them (after sending this event)."""

    request_id: str
    version: str  # the label the committed weights get ("" keeps the current label)
    pause_mode: str  # abort | wait | keep | none; "" takes the server's weight-transfer-config pause_mode
    clear_cache: bool
    updates: list[UpdateInfo]  # update_info of each update_weights call
    timeout_s: float


@message(41)
class WeightUpdateResult(Wire):
    request_id: str
    ok: bool
    version: str
    weight_epoch: int
    timings_s: dict[str, float] = {}  # per step
    # when not ok: which step failed and why, with the HTTP status the same failure gets over HTTP
    error: ErrorInfo | None = None


@message(42)
class WeightVersionCommitted(Wire):
    """Published on the commands XPUB (topic WEIGHTS_TOPIC) whenever a weight update commits, whoever
    drove it (HTTP or bus): every worker has the new weights in service."""

    version: str
    weight_epoch: int
    committed_at: float  # unix time


@message(43)
class WeightVersionLost(Wire):
    """Published on the commands XPUB (topic WEIGHTS_TOPIC) when a restarted worker could not restore the
    weight version in service: the engine refuses requests (503) until a trainer sends a full update."""

    version: str
    weight_epoch: int
    member: str  # the worker that lost it
    why: str
    lost_at: float  # unix time


def message_kinds() -> dict[int, str]:
    return {k: c.__name__ for k, c in REGISTRY.items()}


def _type_text(t: Any) -> str:
    """A stable spelling of a field's type (independent of the msgspec and Python versions)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is None:
        if isinstance(t, type):
            return t.__qualname__
        return "Any" if t is Any else repr(t)
    if origin in (Union, types.UnionType):
        return "Union[" + ",".join(sorted(_type_text(a) for a in args)) + "]"
    return f"{_type_text(origin)}[{','.join(_type_text(a) for a in args)}]"


def _default_text(f: msgspec.structs.FieldInfo) -> str:
    if f.default is not msgspec.NODEFAULT:
        return repr(f.default)
    if f.default_factory is not msgspec.NODEFAULT:
        return repr(f.default_factory())
    return "required"


def wire_structs() -> list[type]:
    """Every struct that can travel: the messages, and every struct their fields reach (commands, results,
    reports, nested parts), found by walking the field types."""
    seen: set[type] = set()
    todo: list[Any] = [*REGISTRY.values(), *AnyCommand.__args__, *AnyResult.__args__, HelloPreamble]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            if t in seen:
                continue
            seen.add(t)
            todo += [f.type for f in msgspec.structs.fields(t)]
        else:
            todo += typing.get_args(t)
    return sorted(seen, key=lambda c: c.__qualname__)


def protocol_fingerprint() -> str:
    """A hash of every struct definition on the wire: kinds, names, tags, and each field's name, type and
    default, in order (array-like structs travel positionally, so the order is part of the format), and the
    results each command declares."""
    desc = []
    for cls in wire_structs():
        cfg = cls.__struct_config__
        results = [r.__qualname__ for r in getattr(cls, "RESULTS", ())]
        desc.append([cls.__qualname__, str(cfg.tag), getattr(cls, "KIND", None), bool(cfg.array_like),
                     [[f.name, _type_text(f.type), _default_text(f)] for f in msgspec.structs.fields(cls)],
                     *([results] if results else [])])
    blob = msgspec.json.encode(desc)
    return hashlib.sha256(blob).hexdigest()[:12]
