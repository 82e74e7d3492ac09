"""Server counters and their Prometheus text rendering (exposition format 0.0.4), plus the loop-lag probe.

No client library: a handful of counters and gauges, written out by hand in the text format.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from .labels import prom_label

__all__ = ["Metrics", "watch_loop_lag"]


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # (route template or "other", status) -> count
    closed: Counter = field(default_factory=Counter)    # why the server closed a connection -> count
    connections: int = 0                                # open now
    prompt_tokens: int = 0
    cached_tokens: int = 0
    disk_tokens: int = 0       # of cached_tokens, loaded from the prefix cache on disk
    prompt_windows: int = 0    # prefill steps that took a long prompt's window
    completion_tokens: int = 0
    rejected_queue_full: int = 0
    disconnects: int = 0
    ttft_sum: float = 0.0  # seconds from arrival to the first token, over requests that got one
    ttft_count: int = 0
    loop_lag: float = 0.0   # the latest probe: how late a timer fired, seconds
    loop_lag_max: float = 0.0
    started: float = field(default_factory=time.time)

    def render(self, *, model, admission, state: str) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP clutor_{name} {help_}")
            out.append(f"# TYPE clutor_{name} {kind}")
            for labels, value in samples:
                out.append(f"clutor_{name}{labels} {_num(value)}")

        metric("requests_total", "counter", "HTTP requests answered, by route and status code (499: the client "
                                             "did not get the whole response: it left, or was cut off, first).",
               [(f'{{endpoint="{prom_label(e)}",status="{int(s)}"}}', n) for (e, s), n in sorted(self.requests.items())])
        metric("connections_open", "gauge", "HTTP connections open.", [("", self.connections)])
        metric("connections_closed_total", "counter", "Connections the server cut: a header, body or write "
                                                      "timeout, over the connection cap, a head over its bounds, or "
                                                      "an unparsable request.",
               [(f'{{reason="{prom_label(r)}"}}', n) for r, n in sorted(self.closed.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of generation requests.", [("", self.prompt_tokens)])
        metric("cached_prompt_tokens_total", "counter", "Prompt tokens whose KV was reused.", [("", self.cached_tokens)])
        metric("disk_prompt_tokens_total", "counter", "Prompt tokens whose KV was loaded from the prefix cache on disk.",
               [("", self.disk_tokens)])
        metric("prompt_windows_total", "counter", "Prefill steps that took a window of a long prompt (each expert "
                                                  "read once for the window).", [("", self.prompt_windows)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
        metric("rejected_total", "counter", "Requests refused with 429 because the queue was full.",
               [("", self.rejected_queue_full)])
        metric("client_disconnects_total", "counter", "Generation requests whose client left, or was cut off, before "
                                                       "it had the whole response (a generation still running is "
                                                       "cancelled).",
               [("", self.disconnects)])
        metric("time_to_first_token_seconds", "summary", "From a request's arrival to its first token.",
               [("_sum", self.ttft_sum), ("_count", self.ttft_count)])
        metric("queue_depth", "gauge", "Requests waiting for a place in the batch.", [("", admission.queued)])
        metric("requests_running", "gauge", "Requests admitted and generating.", [("", admission.live)])
        ready = model is not None
        metric("model_ready", "gauge", "1 once the model is loaded and serving.", [("", 1 if state == "ok" else 0)])
        if ready:
            es = model.engine_stats()
            metric("live_sequences", "gauge", "Sequences in the engine's batch.", [("", es.live_sequences)])
            metric("engine_queued", "gauge", "Sequences submitted to the engine, waiting for a batch place.",
                   [("", es.queued)])
            metric("kv_bytes", "gauge", "KV cache bytes held by live sequences.", [("", es.kv_bytes)])
            metric("prefix_cache_bytes", "gauge", "KV bytes kept from finished sequences for prefix reuse.",
                   [("", es.prefix_bytes)])
            metric("prefix_cache_entries", "gauge", "Finished sequences kept for prefix reuse.",
                   [("", es.prefix_entries)])
            store = getattr(getattr(model, "kv", None), "disk", None)
            disk = store.stats() if store is not None else None
            if disk is not None:
                metric("prefix_cache_disk_bytes", "gauge", "Bytes of KV pages in the prefix cache on disk.",
                       [("", disk.bytes)])
                metric("prefix_cache_disk_pages_total", "counter", "KV pages written to, loaded from, or ignored "
                                                                    "in the prefix cache on disk (did not match), "
                                                                    "or not written (writes failing).",
                       [('{op="written"}', disk.written), ('{op="loaded"}', disk.loaded),
                        ('{op="rejected"}', disk.rejected), ('{op="dropped"}', disk.dropped)])
            metric("engine_steps_total", "counter", "Batched forward steps run.", [("", es.steps)])
            metric("engine_step_rows_total", "counter", "Token rows computed over all steps.", [("", es.step_rows)])
            eng = model.engine
            metric("draft_tokens_total", "counter", "Tokens drafted by speculative decoding and verified.",
                   [("", eng.spec_drafted)])
            metric("draft_tokens_accepted_total", "counter", "Drafted tokens kept (each a token without a step "
                                                             "of its own).", [("", eng.spec_accepted)])
        io = model.io_stats() if ready else None
        if io is not None:
            metric("expert_accesses_total", "counter", "Routed experts demanded.", [("", io.accesses)])
            metric("expert_cache_hits_total", "counter", "Routed experts found in the cache.", [("", io.hits)])
            metric("expert_cache_hit_rate", "gauge", "Cache hits over accesses since start.",
                   [("", io.hits / io.accesses if io.accesses else 0.0)])
            metric("expert_bytes_read_total", "counter", "Bytes read from disk for experts (demand + prefetch).",
                   [("", io.bytes_demand + io.bytes_prefetch)])
            metric("expert_cache_bytes", "gauge", "Memory of the expert cache.", [("", io.arena_bytes)])
        metric("event_loop_lag_seconds", "gauge", "How late the latest 100 ms timer fired.", [("", self.loop_lag)])
        metric("event_loop_lag_max_seconds", "gauge", "Largest loop lag seen since start.", [("", self.loop_lag_max)])
        metric("start_time_seconds", "gauge", "Unix time the server started.", [("", self.started)])
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if isinstance(v, int) or float(v).is_integer() else repr(float(v))


async def watch_loop_lag(metrics: Metrics, period: float = 0.1) -> None:
    """Sleep ``period`` over and over; whatever it overshoots is time the loop was busy elsewhere."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period)
        lag = max(loop.time() - t - period, 0.0)
        metrics.loop_lag = lag
        metrics.loop_lag_max = max(metrics.loop_lag_max, lag)
