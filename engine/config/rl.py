"""What an RL trainer needs of the engine: RL mode (--additional-config), weight transfer and recovery,
sleep mode, and the training-data contract (logprob mode, tokens in/out, trace replay, routed experts,
sampling masks).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from engine.argv import Switch, json_object_type
from engine.rl_config import AdditionalConfig, parse_additional_config
from engine.weights.config import WeightTransferConfig, parse_weight_transfer_config

SCALE_OUT_ENV = "VLLM_ENABLE_SCALE_OUT_ENDPOINTS"


@dataclass(slots=True)
class RLServingConfig:
    additional_config: AdditionalConfig = field(default_factory=AdditionalConfig)  # engine.rl_config
    enable_sleep_mode: bool = False
    weight_transfer_config: WeightTransferConfig | None = None  # engine.weights.config; None: no flag
    weights_recovery_dir: str | None = None  # workers keep a copy of each committed update here (recovery)
    weights_recovery_resume: bool = False  # at start, serve the version those copies hold (engine.fleet.rejoin)
    weights_catch_up: bool = True  # ... or, when the fleet moved on, fetch its version from a peer (catch_up)
    weights_catch_up_peers: list[str] = field(default_factory=list)  # peers to ask at start (a new engine's fleet)
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs | raw_logits | processed_logits
    tokens_only: bool = False  # no tokenizer anywhere; /inference/v1/generate on
    enable_scale_out: bool = False  # /inference/v1/generate and /inference/v1/abort_requests on
    enable_trace_replay: bool = False  # sampling_params.trace_decode_token_ids allowed
    enable_return_routed_experts: bool = False  # MoE: each choice returns its router top-k (docs/tokens.md)
    return_sampling_mask: bool = False  # vLLM's: per generated token, the ids the sampler could draw

    @property
    def scale_out_enabled(self) -> bool:
        """vLLM v0.33: --enable-scale-out or --tokens-only (or VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1, the
        releases between) register the tokens-in/tokens-out routes; otherwise they answer 403."""
        return self.tokens_only or self.enable_scale_out or os.environ.get(SCALE_OUT_ENV, "").strip() == "1"


def check_catch_up_peers(rl: RLServingConfig) -> None:
    """--weights-catch-up-peers: URLs, and (with catch-up on) a folder for the copies fetched from them."""
    bad = [u for u in rl.weights_catch_up_peers if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"--weights-catch-up-peers takes the engines' URLs (http:// or https://), got {bad[0]!r}")
    if rl.weights_catch_up_peers and rl.weights_catch_up and not rl.weights_recovery_dir:
        raise ValueError("--weights-catch-up-peers fetches the fleet's weights into --weights-recovery-dir: give "
                         "that too (or --no-weights-catch-up: answer 503 naming the fleet's version instead)")


def _weight_transfer_text(c: WeightTransferConfig) -> str:
    return json.dumps({"backend": c.name, "stage_updates": c.stage_updates, "timeout_s": c.timeout_s,
                       "pause_mode": c.pause_mode})


JSON_FLAGS = {
    "additional_config": (parse_additional_config, lambda c: json.dumps(c.raw)),
    "weight_transfer_config": (parse_weight_transfer_config, _weight_transfer_text),
}


def add_args(p: argparse.ArgumentParser) -> None:
    d = RLServingConfig()
    g = p.add_argument_group("RL")
    g.add_argument("--additional-config", type=json_object_type("--additional-config"), default=None,
                   help='JSON object. {"rl_config": {"enabled": true}} turns on RL mode: development endpoints '
                        "(/pause, /resume, /is_paused, /server_info, ...), NZ weight format off, "
                        "expandable_segments stripped from the allocator config of workers. Optional "
                        "rl_config keys (only with enabled): sleep_mode_extra_cleanup, "
                        "enable_training_consistency (the batch-invariant kernels "
                        "engine.trainer.use_engine_kernels reproduces), "
                        "enable_batch_invariant (batch-invariant "
                        "kernels, verified on the device at start-up; VLLM_BATCH_INVARIANT=1 does the same). "
                        "vLLM's dotted form works: "
                        "--additional-config.rl_config.enabled true.")
    g.add_argument("--enable-sleep-mode", action=Switch, negatives=["--disable-sleep-mode"], default=False,
                   help="Allow /sleep and /wake_up (weights and KV cache released by tag).")
    g.add_argument("--weight-transfer-config", type=json_object_type("--weight-transfer-config"), default=None,
                   help='JSON object. {"backend": "ipc"} (trainer on the same device: CUDA/NPU IPC, shared '
                        'memory on CPU) or {"backend": "hccl"} (separate devices: HCCL/NCCL/Gloo broadcast); '
                        "aliases npu_ipc, nccl, gloo. Without backend ('{}') the platform's collective, as vLLM "
                        "defaults to nccl: nccl on CUDA, hccl on NPU, gloo on CPU. Enables "
                        "/init_weight_transfer_engine, /start_weight_update, "
                        "/update_weights, /finish_weight_update. Optional: stage_updates (default true: a failed "
                        "update leaves the old weights in service; costs one extra copy of the updated weights), "
                        "timeout_s (default 300).")
    g.add_argument("--weights-recovery-dir", default=d.weights_recovery_dir,
                   help="After every committed weight update each worker writes its weights here "
                        "(worker-<rank>.safetensors, tagged with the run and update), so a worker restarted "
                        "after an update serves that version again instead of losing it. Costs one write of "
                        "the model per update (use a RAM disk such as /dev/shm for speed). Without it, a "
                        "worker restarted after an update refuses requests (503 naming the version) until "
                        "the trainer sends the weights again.")
    g.add_argument("--weights-recovery-resume", action=Switch, default=False,
                   help="At start, serve the weight version whose copies --weights-recovery-dir holds (from an "
                        "earlier run of this engine) instead of the checkpoint: an engine restarted by its "
                        "supervisor rejoins its fleet on the fleet's version. A worker whose copy is missing or "
                        "of another update answers 503 naming that version until the next full update. Without "
                        "copies: the checkpoint. Needs --weights-recovery-dir.")
    g.add_argument("--weights-catch-up", action=Switch, default=d.weights_catch_up,
                   help="With --weights-recovery-resume or --weights-catch-up-peers (rollbus's own; on by default): "
                        "when a peer in the engine's last fleet update (its fleet.json) or among those flags' peers "
                        "committed a newer version while this engine was down (or before it joined), fetch that "
                        "version's weights from the peer's copies (GET /weight_copy: checked against the version, "
                        "a digest and the peer's /weight_checker checksums; all workers or none) before serving, "
                        "within the weight transfer's timeout_s, instead of answering 503 naming it until the "
                        "trainer's next update; a worker restarted without its copy takes it from those peers the "
                        "same way. --no-weights-catch-up keeps the 503.")
    g.add_argument("--weights-catch-up-peers", nargs="+", default=[], metavar="URL",
                   help="rollbus's own: the fleet's other engines (http://host:port ...), asked at start beside "
                        "those in the fleet record of --weights-recovery-dir. An engine joining a fleet (no copies "
                        "of its own, on its checkpoint) whose peers committed a weight version fetches that version "
                        "from them as --weights-catch-up does, before serving; when it cannot (or with "
                        "--no-weights-catch-up) it answers 503 naming the version, never serving its checkpoint "
                        "under the fleet's name. No peer answering: the checkpoint. Needs --weights-recovery-dir "
                        "(where the fetched copies go) unless --no-weights-catch-up.")
    g = p.add_argument_group("training data (logprobs, tokens in/out, trace replay, routed experts; docs/logprobs.md, "
                             "docs/tokens.md)")
    g.add_argument("--logprobs-mode", default=d.logprobs_mode,
                   choices=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"],
                   help="What logprobs report, as vLLM: raw_* come from the model's logits before penalties and "
                        "temperature; processed_* from the logits the sampler drew from (penalties, temperature, "
                        "min_p, top_k, top_p applied; filtered tokens -inf, so processed_logprobs are "
                        "renormalised over what was kept). *_logits report logits instead of log-probabilities. "
                        "Prompt logprobs are always raw logprobs.")
    g.add_argument("--tokens-only", action=Switch, default=False,
                   help="Serve token ids only: no tokenizer is loaded or called; /inference/v1/generate is on; "
                        "stop strings and text prompts are refused (400).")
    g.add_argument("--enable-scale-out", action=Switch, negatives=["--disable-scale-out"], default=False,
                   help=f"Register POST /inference/v1/generate and /inference/v1/abort_requests (tokens in, "
                        f"tokens out); without it (or --tokens-only, or {SCALE_OUT_ENV}=1) they answer 403.")
    g.add_argument("--enable-trace-replay", action=Switch, negatives=["--disable-trace-replay"], default=False,
                   help="Allow sampling_params.trace_decode_token_ids on /inference/v1/generate: those tokens are "
                        "forced as the output while logprobs and ranks come from the model's distribution. "
                        "VLLM_USE_V2_MODEL_RUNNER is accepted and ignored (the one model runner supports it).")
    g.add_argument("--enable-return-routed-experts", action=Switch, negatives=["--disable-return-routed-experts"],
                   default=False,
                   help="Mixture-of-experts models: every choice of /v1/completions, /v1/chat/completions and "
                        "/inference/v1/generate returns `routed_experts`, the experts the router picked (top-k, "
                        "best first) at every MoE layer for every prompt and generated token except the last: "
                        "base64 of a .npy array (num_tokens - 1 - routed_experts_prompt_start, num_moe_layers, "
                        "top_k), uint8 with at most 256 experts, else uint16. For router replay in training. "
                        "Dense models (and requests aborted before any forward pass) return null.")
    g.add_argument("--return-sampling-mask", action=Switch, negatives=["--no-return-sampling-mask"], default=False,
                   help="vLLM's: every choice of /inference/v1/generate (and each of its stream chunks) returns "
                        "`sampling_mask`, per generated token the ids the sampler could have drawn (ascending): what "
                        "top-k, top-p, min-p, allowed_token_ids, bad_words, min_tokens and a grammar kept, the "
                        "support of the processed distribution, so the sampled token is always in it. For "
                        "trainers that renormalise their logprobs over the same support (keep sampling mask, "
                        "truncated importance sampling; pair it with --logprobs-mode processed_logprobs). A token "
                        "drawn with nothing filtered lists the whole vocabulary. Without the flag it is null.")
