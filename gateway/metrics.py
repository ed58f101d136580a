"""Prometheus metrics at /metrics, in the text exposition format (0.0.4), written by hand.

Names are vLLM's where the quantity is the same, so existing dashboards work; what only rollbus has is
prefixed `rollbus_`. Counters and latency histograms are kept here (the gateway sees every request
finish); gauges come from the scheduler's stats that arrive with every output batch.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds as vLLM uses them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

# scheduler stats key -> (metric name, help)
_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "step_time_s": ("rollbus_step_time_seconds", "Moving average of the scheduler's step duration."),
}
# scheduler counters -> (metric name, help)
_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine."),
    "prompt_tokens": ("rollbus_prefill_tokens_computed_total",
                      "Prompt tokens the engine computed (prefix-cache hits excluded)."),
    "generation_tokens": ("rollbus_engine_generation_tokens_total", "Tokens the engine sampled."),
    "prefix_cache_queries": ("rollbus_prefix_cache_queried_blocks_total",
                             "KV blocks looked up in the prefix cache."),
    "prefix_cache_hits": ("rollbus_prefix_cache_hit_blocks_total", "KV blocks found in the prefix cache."),
}
_FINISH_REASONS = ("stop", "length", "abort")


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Histogram:
    """Cumulative-bucket histogram (observations are rare enough that a linear scan is fine)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.bounds = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, times: int = 1) -> None:
        i = 0
        while i < len(self.bounds) and v > self.bounds[i]:
            i += 1
        self.counts[i] += times
        self.sum += v * times
        self.count += times

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, c in zip((*self.bounds, math.inf), self.counts):
            running += c
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _fmt(bound)})} {running}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_fmt(self.sum)}")
        return lines


class Metrics:
    """Gateway-side counters and histograms plus the engine's gauges, rendered on demand."""

    def __init__(self, model_name: str, stats: Callable[[], dict[str, float]] = dict,
                 healthy: Callable[[], bool] = lambda: True):
        self.labels = {"model_name": model_name}
        self.stats, self.healthy = stats, healthy
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cache_queries = 0
        self.cache_hits = 0
        self.finished: dict[str, int] = {r: 0 for r in _FINISH_REASONS}
        self.errors = 0
        self.started = time.time()
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", E2E_BUCKETS)

    def observe_choice(self, state: Any) -> None:
        """Record one finished (or abandoned) engine request; `state` is a serving.ChoiceState."""
        now = time.monotonic()
        n_prompt, n_gen = len(state.prompt_ids), len(state.token_ids)
        self.prompt_tokens += n_prompt
        self.generation_tokens += n_gen
        self.cache_queries += n_prompt
        self.cache_hits += min(state.num_cached_tokens, n_prompt)
        reason = state.finish_reason or "abort"
        if reason == "error":
            self.errors += 1
        else:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(now - state.arrival)
        if state.first_token_at is not None:
            self.ttft.observe(state.first_token_at - state.arrival)
            if n_gen > 1:
                # the mean gap between tokens of this request, observed once per token like vLLM
                self.itl.observe((now - state.first_token_at) / (n_gen - 1), n_gen - 1)

    def render(self) -> str:
        lab = self.labels
        out: list[str] = []

        def scalar(name: str, kind: str, help: str, value: float, extra: dict[str, str] | None = None,
                   header: bool = True) -> None:
            if header:
                out.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            out.append(f"{name}{_labels({**lab, **(extra or {})})} {_fmt(value)}")

        stats = dict(self.stats() or {})
        for key, (name, help) in _GAUGES.items():
            scalar(name, "gauge", help, float(stats.pop(key, 0.0)))
        for key, (name, help) in _COUNTERS.items():
            if key in stats:
                scalar(name, "counter", help, float(stats.pop(key)))
        steps, step_sum = stats.pop("steps", None), stats.pop("step_time_total", None)
        if steps is not None and step_sum is not None:
            out.extend(["# HELP rollbus_step_latency_seconds Scheduler step latency.",
                        "# TYPE rollbus_step_latency_seconds summary",
                        f"rollbus_step_latency_seconds_count{_labels(lab)} {_fmt(steps)}",
                        f"rollbus_step_latency_seconds_sum{_labels(lab)} {_fmt(step_sum)}"])
        for key, value in sorted(stats.items()):  # whatever else the scheduler reports
            if isinstance(value, (int, float)):
                name = "rollbus_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                kind = "counter" if name.endswith("_total") else "gauge"
                scalar(name, kind, f"Scheduler statistic {key}.", float(value))
        scalar("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
        scalar("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               self.generation_tokens)
        scalar("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of "
               "queried tokens.", self.cache_queries)
        scalar("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached "
               "tokens.", self.cache_hits)
        for i, (reason, count) in enumerate(sorted(self.finished.items())):
            scalar("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   count, {"finished_reason": reason}, header=i == 0)
        scalar("rollbus_request_errors_total", "counter", "Engine requests that ended in an error.", self.errors)
        scalar("rollbus_engine_healthy", "gauge", "1 while the engine is alive, else 0.",
               1.0 if self.healthy() else 0.0)
        for h in (self.ttft, self.itl, self.e2e):
            out.extend(h.render(lab))
        return "\n".join(out) + "\n"
