"""Every setting of `heron route`, in one frozen dataclass the CLI fills from its flags.

Flag names follow SGLang's model gateway (``--worker-urls``, ``--policy``, ``--cb-*``,
``--retry-*``, ``--health-*``, ``--max-concurrent-requests``, ``--queue-*``) where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

POLICIES = ("round_robin", "random", "power_of_two", "least_load", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    """The router's settings. Limits of ``None`` (or 0) are off. Times are in seconds unless
    the name says ``_ms``. Immutable: the running router never changes its settings."""

    host: str = "127.0.0.1"
    port: int = 30000
    worker_urls: tuple[str, ...] = ()
    worker_file: str | None = None  # one URL a line ('#' comments); re-read when it changes
    policy: str = "round_robin"
    api_key: str | None = None  # the router's own key (clients and /workers admin)
    worker_api_key: str | None = None  # sent upstream as Bearer
    # the router's own admission: in-flight limit, a bounded queue in front of it
    max_concurrent_requests: int | None = 256
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 5.0
    # retries, on another worker, only before the first byte reached the client
    retry_max_retries: int = 3
    retry_initial_backoff_ms: int = 50
    retry_max_backoff_ms: int = 2000
    retry_backoff_multiplier: float = 2.0
    retry_jitter_factor: float = 0.1
    # circuit breaker, one per worker
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    disable_circuit_breaker: bool = False
    # active health checks (GET /health), plus a scrape of /metrics and /server_info
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    # saturation: a worker that answered 429 rests this long (or its Retry-After)
    worker_429_cooldown_secs: float = 1.0
    max_worker_waiting_requests: int | None = None
    # input guards, before any worker sees the request
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int | None = None  # on the estimate len(text) // 4 + 1
    max_n: int | None = 16
    max_tokens_limit: int | None = None
    # cache-aware policy (heron.route.policies.cache_aware)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2 ** 20  # approximate tree size in characters
    eviction_interval_s: float = 60.0
    tokenizer: str | None = None
    # metrics and shutdown
    cost_per_gpu_hour: float | None = None  # per worker, for heron_router:cost_per_million_tokens
    shutdown_timeout_secs: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        for name in ("cb_failure_threshold", "cb_success_threshold", "health_failure_threshold",
                     "health_success_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.retry_max_retries < 0 or self.queue_size < 0:
            raise ValueError("retry_max_retries and queue_size must be >= 0")

    @property
    def max_attempts(self) -> int:
        """Tries per request: the first one plus the retries."""
        return 1 + self.retry_max_retries

    @classmethod
    def from_namespace(cls, args) -> "RouterConfig":
        """Build from an argparse namespace: every attribute named like a field is taken."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("worker_urls") is not None:
            values["worker_urls"] = tuple(values["worker_urls"])
        else:
            values.pop("worker_urls", None)
        return cls(**values)
