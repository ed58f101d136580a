"""Prometheus metrics at /metrics, with prometheus_client (one registry per app).

Names, types, label names and bucket bounds are vLLM's (v0.33 vllm/v1/metrics/loggers.py, buckets.py)
where the quantity is the same, so vLLM dashboards work; what only rollbus has is prefixed `rollbus_`.
Every sample carries vLLM's labels model_name (the first served name) and engine: the data-parallel engine
index ("0" with one engine). The scheduler stats, token and request counters and latency histograms have one
series per engine (the engine a request ran on); health, sleep state and the gateway's own gauges are
reported once, as engine "0".

Two sources: the gateway's own counters and histograms, kept live as engine outputs arrive (the gateway
sees every token of every request), and the scheduler's stats, which arrive with every output batch and
are read at scrape time by a collector (gauges, and counters the scheduler keeps the totals of).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import choose_encoder

LABELS = ["model_name", "engine"]  # vLLM's per-engine labels
ENGINE = "0"

# vLLM's default bucket bounds (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's FinishReason strings; every one is exposed from the start (at 0), as vLLM does
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

# scheduler stats key -> (metric name, help)
_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "step_time_s": ("rollbus_step_time_seconds", "Moving average of the scheduler's step duration."),
}
# scheduler counters -> (metric name without _total, help); shown once the scheduler has reported them
_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("rollbus_prefill_tokens_computed",
                      "Prompt tokens the engine computed (prefix-cache hits excluded)."),
    "generation_tokens": ("rollbus_engine_generation_tokens", "Tokens the engine sampled."),
    "prefix_cache_queries": ("rollbus_prefix_cache_queried_blocks", "KV blocks looked up in the prefix cache."),
    "prefix_cache_hits": ("rollbus_prefix_cache_hit_blocks", "KV blocks found in the prefix cache."),
}
_SUMMARY_KEYS = ("steps", "step_time_total")  # -> rollbus_step_latency_seconds _count / _sum


class _SchedulerStats:
    """Collector: the scheduler's latest stats as metric families, read when /metrics is scraped. Any
    number the scheduler adds shows up as rollbus_<key> (a counter when the key ends in _total)."""

    def __init__(self, model_name: str, stats: Callable[[], Any], reserved: set[str]):
        self.model_name, self.stats, self.reserved = model_name, stats, reserved

    def collect(self) -> Iterator[Metric]:
        per_engine = self.stats() or {}
        if isinstance(per_engine, dict):  # one engine's stats
            per_engine = [per_engine]
        families: dict[str, Metric] = {}  # one family per name, one sample per engine

        def add(name: str, make: Callable[[], Metric], labels: list[str], **value: float) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = make()
            family.add_metric(labels, **value)

        for engine, stats in enumerate(per_engine):
            stats = dict(stats or {})
            lv = [self.model_name, str(engine)]
            for key, (name, doc) in _GAUGES.items():
                add(name, lambda n=name, d=doc: GaugeMetricFamily(n, d, labels=LABELS), lv,
                    value=float(stats.pop(key, 0.0)))
            for key, (name, doc) in _COUNTERS.items():
                if key in stats:
                    add(name, lambda n=name, d=doc: CounterMetricFamily(n, d, labels=LABELS), lv,
                        value=float(stats.pop(key)))
            steps, step_sum = (stats.pop(k, None) for k in _SUMMARY_KEYS)
            if steps is not None and step_sum is not None:
                add("rollbus_step_latency_seconds", lambda: SummaryMetricFamily(
                    "rollbus_step_latency_seconds", "Scheduler step latency.", labels=LABELS), lv,
                    count_value=float(steps), sum_value=float(step_sum))
            for key, value in sorted(stats.items()):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                name = "rollbus_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                if name in self.reserved or name.removesuffix("_total") in self.reserved:
                    continue  # never a second family under a name the gateway owns
                doc = f"Scheduler statistic {key}."
                kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                add(name, lambda n=name, d=doc, k=kind: k(n, d, labels=LABELS), lv, value=float(value))
        yield from families.values()


class PerEngine:
    """One labelled child per engine of a counter or histogram: `metric[engine].inc()`; the bare
    `inc`/`observe` are engine 0's."""

    def __init__(self, metric: Any, model_name: str, engines: list[str]):
        self.children = [metric.labels(model_name, e) for e in engines]

    def __getitem__(self, engine: int) -> Any:
        return self.children[engine]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.children[0], name)


class Metrics:
    """The gateway's metrics registry: request counters and latency histograms it records itself, the
    engine's gauges through a collector, the sleep state and health as callback gauges."""

    def __init__(self, model_name: str, stats: Callable[[], Any] = dict,
                 healthy: Callable[[], bool] = lambda: True, sleep_state: Callable[[], str] = lambda: "awake",
                 open_sequences: Callable[[], int] = lambda: 0, open_engine_requests: Callable[[], int] = lambda: 0,
                 num_engines: int = 1):
        """`stats`: the schedulers' latest stats, a list with one dict per engine (or one engine's dict)."""
        self.registry = reg = CollectorRegistry()
        lv = [model_name, ENGINE]
        self.labels = dict(zip(LABELS, lv))
        reg.register(_SchedulerStats(model_name, stats, reserved={
            "rollbus_request_errors", "rollbus_engine_healthy", "rollbus_step_latency_seconds",
            *(name for name, _ in _GAUGES.values()), *(name for name, _ in _COUNTERS.values())}))

        engines = [str(e) for e in range(num_engines)]

        def counter(name: str, doc: str) -> PerEngine:
            return PerEngine(Counter(name, doc, LABELS, registry=reg), model_name, engines)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> PerEngine:
            return PerEngine(Histogram(name, doc, LABELS, registry=reg, buckets=buckets), model_name, engines)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=reg)
        for engine in engines:  # every reason of every engine from the start, as vLLM
            for r in FINISH_REASONS:
                success.labels(model_name, engine, r)
        self.request_success = {r: success.labels(*lv, r) for r in FINISH_REASONS}
        self._success, self._model_name = success, model_name
        self.errors = counter("rollbus_request_errors", "Engine requests that ended in an error.")
        rejections = Counter("vllm:admission_rejections",  # vLLM's labels: no engine label
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=reg)
        self.admission_rejections = {r: rejections.labels(model_name, r)
                                     for r in ("max_num_queued_reqs", "max_num_queued_tokens")}
        Gauge("rollbus_engine_healthy", "1 while the engine is alive, else 0.", LABELS, registry=reg) \
            .labels(*lv).set_function(lambda: 1.0 if healthy() else 0.0)
        # what the gateway holds for requests in flight: both are 0 once every request (finished, refused,
        # aborted, or dropped by its client) is over, which the soak (bench/soak.py) checks
        Gauge("rollbus_gateway_open_sequences", "Engine sequences admitted and not yet released "
              "(counted against --max-num-queued-reqs).", LABELS, registry=reg) \
            .labels(*lv).set_function(lambda: float(open_sequences()))
        Gauge("rollbus_gateway_open_engine_requests", "Engine requests whose outputs the gateway is waiting for.",
              LABELS, registry=reg).labels(*lv).set_function(lambda: float(open_engine_requests()))
        sleep = Gauge("vllm:engine_sleep_state",
                      "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                      "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                      LABELS + ["sleep_state"], registry=reg)
        for s in SLEEP_STATES:
            sleep.labels(*lv, s).set_function(lambda s=s: float(sleep_state() == s))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             E2E_BUCKETS)

    def observe_delta(self, state: Any, update: Any) -> None:
        """After every engine delta of a choice (`state` a serving.ChoiceState, `update` what its feed
        returned): the first tokens give TTFT, each later delta with tokens one inter-token gap, as
        vLLM records one ITL per engine step of the request."""
        engine = getattr(state, "engine", 0)
        if not state.admitted:  # the engine's first output for it: the request was admitted
            state.admitted = True
            self._prefix_lookup(state, engine)
        if not update.token_ids:
            return
        if state.gap is None:
            self.ttft[engine].observe(state.first_token_at - state.arrival)
        else:
            self.itl[engine].observe(state.gap)

    def _prefix_lookup(self, state: Any, engine: int) -> None:
        """vLLM's prefix-cache queries and hits, in tokens: recorded once per engine request when it is admitted
        (here: its first output, which carries what admission found cached), so a request aborted before it
        was admitted counts nothing, and a prompt_logprobs request, which never looks the cache up, neither."""
        if state.params.prompt_logprobs is not None:
            return
        n_prompt = len(state.prompt_ids)
        self.prefix_cache_queries[engine].inc(n_prompt)
        self.prefix_cache_hits[engine].inc(min(state.num_cached_tokens, n_prompt))

    def observe_choice(self, state: Any, now: float | None = None) -> None:
        """Record one finished (or abandoned) engine request; `state` is a serving.ChoiceState."""
        now = time.monotonic() if now is None else now
        n_prompt, n_gen = len(state.prompt_ids), len(state.token_ids)
        engine = getattr(state, "engine", 0)
        self.prompt_tokens[engine].inc(n_prompt)
        self.generation_tokens[engine].inc(n_gen)
        reason = state.finish_reason or "abort"
        if reason == "error":
            self.errors[engine].inc()
        self._success.labels(self._model_name, str(engine), reason).inc()
        self.e2e[engine].observe(now - state.arrival)
        if state.first_token_at is not None:  # vLLM: decode time over the tokens after the first, else 0
            decode = state.last_token_at - state.first_token_at
            self.tpot[engine].observe(decode / (n_gen - 1) if n_gen > 1 else 0.0)

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The body and content type for a scrape: the text format (0.0.4), or OpenMetrics when the
        Accept header asks for it (as prometheus_client's own handler, which vLLM mounts, negotiates)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def render(self) -> str:
        """The text exposition (0.0.4), e.g. for logs and tests."""
        return self.exposition()[0].decode("utf-8")
