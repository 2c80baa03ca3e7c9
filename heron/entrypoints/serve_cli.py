"""`heron serve`: its flags (the engine's, shared with `generate`, plus the server's) and the
settings they become."""

from __future__ import annotations

import argparse

from heron.entrypoints.cli import parallel_config, speculative_config


def add_parser(sub, engine_args) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF directory or .gguf file (default: embedded SmolLM2)")
    engine_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="name in /v1/models")
    g.add_argument("--seed", type=int, default=0,
                   help="the engine's sampling seed (requests without their own seed)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="admitted requests beyond this get 429")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="admitted prompt tokens beyond this get 429")
    g.add_argument("--max-queued-sequences", type=int, default=1024,
                   help="admitted sequences (prompts x n) beyond this get 429")
    g.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="a request with more sequences (prompts x n) gets 400")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="a request body over this many bytes gets 413")
    g.add_argument("--cost-per-gpu-hour", type=float, default=None,
                   help="publish heron:cost_per_million_tokens_dollars")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM, in-flight requests get this long to finish (new ones "
                        "503), then are aborted: streams end with an error event, others 503")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ADDR",
                   help="publish prefix-cache events (blocks stored / removed) on a ZMQ PUB "
                        "socket bound here, e.g. tcp://127.0.0.1:5557")


def run(args) -> int:
    from heron.config import CacheConfig, EngineConfig, SchedulerConfig
    from heron.server.app import ServerSettings
    from heron.server.launcher import run

    model = args.model_path or args.model
    config = EngineConfig(
        model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        quantization=args.quantization, kv_events_endpoint=args.kv_events_endpoint,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        seed=args.seed, num_threads=args.threads,
        distributed_executor_backend=args.distributed_executor_backend,
        parallel=parallel_config(args), speculative=speculative_config(args),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          max_memory_gb=args.kv_cache_memory,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  policy=args.scheduling_policy))
    settings = ServerSettings(
        served_model_name=args.served_model_name or model or "SmolLM2-135M-Instruct",
        api_key=args.api_key, max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_queued_sequences=args.max_queued_sequences,
        max_sequences_per_request=args.max_sequences_per_request,
        max_body_bytes=args.max_body_bytes,
        cost_per_gpu_hour=args.cost_per_gpu_hour, shutdown_timeout=args.shutdown_timeout)
    if config.parallel.node_rank > 0:
        from heron.executor.multiproc import run_node_ranks

        return run_node_ranks(config)  # this node's ranks; node 0 serves
    return run(config, settings, args.host, args.port)
