"""The engine's step metrics, in a service's registry: prefill and decode both run the batched engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvserve.engine.engine import StepStats
    from kvserve.engine.native import AttentionKernel

# Seconds: rpc.metrics.LATENCY_BUCKETS, the services' own (the engine imports no rpc module, which would bring grpc).
QUEUE_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)


class EngineMetrics:
    """Per forward: sequences and tokens, its time and the step thread's time off its core; sequences running and
    waiting; the pool's blocks; preemptions, prompt tokens computed, pool prefix hits (coalesced ones among them),
    queue wait. Once: the decode attention the engine runs (`attention`: its runner's; default, that of an engine
    of this process with a float32 KV cache on the CPU)."""

    def __init__(self, registry: CollectorRegistry, prefix: str, attention: AttentionKernel | None = None) -> None:
        p = prefix + "engine_"
        self.attention = Gauge(
            p + "attention_kernel", "The decode attention this engine runs, at 1: native-<march> (the C kernel, "
            "prebuilt for a portable target), native-march-native (built here for this CPU) or sdpa (the slower "
            "fallback, reason says why)", ["kernel", "reason"], registry=registry,
        )
        self.show_attention(attention)
        self.batch_seqs = Histogram(p + "batch_sequences", "Sequences per forward", buckets=BATCH_SEQ_BUCKETS,
                                    registry=registry)
        self.batch_tokens = Histogram(p + "batch_tokens", "Tokens per forward (decode tokens and prompt chunks)",
                                      buckets=BATCH_TOKEN_BUCKETS, registry=registry)
        self.blocks = Gauge(p + "kv_blocks", "KV pool blocks by state: used (by running sequences), cached "
                            "(free but reusable by hash), free", ["state"], registry=registry)
        self.preemptions = Counter(p + "preemptions", "Sequences preempted for lack of KV blocks",
                                   registry=registry)
        self.pool_hit_tokens = Counter(p + "pool_hit_tokens", "Prompt tokens whose KV was reused from the pool",
                                       registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens whose KV the engine computed",
                                     registry=registry)
        self.coalesced_tokens = Counter(
            p + "coalesced_tokens", "Prompt tokens taken from the pool once another running sequence computed "
            "them (in-flight prefix coalescing; also counted in pool_hit_tokens)", registry=registry,
        )
        self.running = Gauge(p + "running_sequences", "Sequences admitted: computing, decoding or loading KV",
                             registry=registry)
        self.waiting = Gauge(p + "waiting_sequences", "Sequences waiting for admission (KV blocks or a slot)",
                             registry=registry)
        self.steps = Counter(p + "steps", "Forwards, by the threads they computed on (more than the service's own: "
                             "cores an idle peer lent, kvserve.host.cores)", ["threads"], registry=registry)
        self.forward_seconds = Counter(p + "forward_seconds", "Wall time in forwards", registry=registry)
        self.off_core_seconds = Counter(
            p + "forward_off_core_seconds", "Of the time in forwards, the step thread off its core: waiting for a core "
            "that other threads or processes held (on a CPU the streams' handlers, the host's other work), or for "
            "Python's lock; a rising share of forward_seconds says the cores are oversubscribed", registry=registry,
        )
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Time from a sequence's arrival to its admission",
                                    buckets=QUEUE_WAIT_BUCKETS, registry=registry)

    def show_attention(self, kernel: AttentionKernel | None) -> None:
        if kernel is None:
            from kvserve.engine import native  # torch: only where an engine runs

            kernel = native.attention_kernel()
        self.attention.clear()
        self.attention.labels(kernel=kernel.name, reason=kernel.reason).set(1)

    def observe(self, stats: StepStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        if stats.num_seqs:
            self.steps.labels(threads=str(stats.num_threads)).inc()
            self.batch_seqs.observe(stats.num_seqs)
            self.batch_tokens.observe(stats.num_tokens)
            self.forward_seconds.inc(stats.forward_s)
            self.off_core_seconds.inc(stats.off_core_s)
        self.blocks.labels(state="used").set(stats.pool_used)
        self.blocks.labels(state="cached").set(stats.pool_cached)
        self.blocks.labels(state="free").set(stats.pool_free)
        self.preemptions.inc(stats.num_preempted)
        self.pool_hit_tokens.inc(stats.num_pool_hit_tokens)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.coalesced_tokens.inc(stats.num_coalesced_tokens)
        for wait in stats.queue_wait_s:
            self.queue_wait.observe(wait)
