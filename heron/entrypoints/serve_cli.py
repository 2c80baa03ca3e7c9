"""`heron serve`: its flags (the engine's, shared with `generate`, plus the server's, under
vLLM's names where vLLM has the option) and the settings they become.

vLLM flags heron has no option for are refused, or accepted when they ask for what heron does
anyway, by the table in :mod:`heron.entrypoints.vllm_flags`.
"""

from __future__ import annotations

import argparse
import logging

from heron.cli_help import HelpFormatter
from heron.entrypoints.engine_args import parallel_config, speculative_config
from heron.entrypoints.serve_options import json_object, load_format, seconds, string_list
from heron.entrypoints.vllm_flags import add_vllm_flags

logger = logging.getLogger("heron.entrypoints")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_parser(sub, engine_args) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           formatter_class=HelpFormatter)
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF directory or .gguf file (default: the embedded SmolLM2)")
    engine_args(serve)
    _server_args(serve)
    _openai_args(serve)
    _http_args(serve)
    add_vllm_flags(serve)


def _server_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--seed", type=int, default=0,
                   help="the engine's sampling seed (requests without their own seed)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: no key)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local tokenizer directory to use instead of the model's")
    g.add_argument("--load-format", type=load_format, default="auto",
                   help="auto (also: safetensors, gguf): the model's files; dummy: random "
                        "weights")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="heron runs on CUDA when torch sees a GPU, else on CPU; cpu / cuda "
                        "only confirm it")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's sake, not needed: heron never runs code from "
                        "the model directory")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="admitted requests beyond this get 429")
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="admitted prompt tokens beyond this get 429 (default: no limit)")
    g.add_argument("--max-queued-sequences", type=int, default=1024,
                   help="admitted sequences (prompts x n) beyond this get 429")
    g.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="a request with more sequences (prompts x n) gets 400")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="a request body over this many bytes gets 413")
    g.add_argument("--request-body-timeout", type=seconds, default=30.0,
                   metavar="SECONDS",
                   help="a request body still arriving this long after its headers gets 408")
    g.add_argument("--cost-per-gpu-hour", type=float, default=None,
                   help="publish heron:cost_per_million_tokens_dollars (default: not "
                        "published)")
    g.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                   metavar="SECONDS",
                   help="after SIGTERM, in-flight requests get this long to finish (new ones "
                        "503), then are aborted: streams end with an error event, others 503")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ADDR",
                   help="publish prefix-cache events (blocks stored / removed) on a ZMQ PUB "
                        "socket bound here, e.g. tcp://127.0.0.1:5557 (default: none)")


def _openai_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("OpenAI API (vLLM's flags)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names a request's `model` may use; responses report the first "
                        "(default: the model path; other names get 404)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template file, or the template itself on one line "
                        "(default: the tokenizer's)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of chat replies (when add_generation_prompt is true)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="requests asking for more logprobs (or top_logprobs) get 400")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="name logprob tokens 'token_id:N' instead of their text")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves unset (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens): auto: "
                        "from the model's generation_config.json; vllm: OpenAI's defaults; "
                        "or a folder holding a generation_config.json")
    g.add_argument("--override-generation-config", type=json_object, default=None,
                   metavar="JSON", help="sampling defaults over the generation config's, "
                   "e.g. '{\"temperature\": 0.5}' (default: none)")
    logs = g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                          default=True)
    logs.help = "one log line per finished request (default: on)"  # no "(default: True)"
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="the same as --no-enable-log-requests (vLLM's older spelling)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic engine-stats log line (default: every 10 s with "
                        "activity)")


def _http_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("HTTP (vLLM's flags)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's log level (info and below: an access log line per request)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc, /openapi.json")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix of a proxy that serves heron under it (default: none)")
    g.add_argument("--allowed-origins", type=string_list, action="extend", default=None,
                   metavar="JSON_LIST", help="turn CORS on for these origins: '[\"https://a."
                   "example\"]', a comma-separated list or '*' (default: CORS off)")
    g.add_argument("--allowed-methods", type=string_list, action="extend", default=None,
                   metavar="JSON_LIST", help="CORS: methods (default with CORS on: all)")
    g.add_argument("--allowed-headers", type=string_list, action="extend", default=None,
                   metavar="JSON_LIST", help="CORS: request headers (default with CORS on: all)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the key file")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates file")


def engine_config(args):
    """The EngineConfig ``args`` ask for (``--dtype auto`` resolved and logged)."""
    from heron.config import CacheConfig, EngineConfig, SchedulerConfig
    from heron.entrypoints.serve_options import engine_dtype

    model = args.model_path or args.model
    _check_device(args.device)
    return EngineConfig(
        model=model, dtype=engine_dtype(args.dtype, model), max_model_len=args.max_model_len,
        quantization=args.quantization, kv_events_endpoint=args.kv_events_endpoint,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        seed=args.seed, num_threads=args.threads, load_format=args.load_format,
        tokenizer=_tokenizer_dir(args.tokenizer),
        distributed_executor_backend=args.distributed_executor_backend,
        parallel=parallel_config(args), speculative=speculative_config(args),
        custom_ops=args.custom_ops, cpu_int8_dot=args.cpu_int8_dot,
        hf_overrides=args.hf_overrides,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          max_memory_gb=args.kv_cache_memory,
                          memory_fraction=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching,
                          streaming_kv=args.streaming_kv),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  policy=args.scheduling_policy))


def server_settings(args):
    """The ServerSettings ``args`` ask for; ValueError / FileNotFoundError for bad values."""
    from heron.server.app import ServerSettings
    from heron.server.generation_defaults import sampling_defaults
    from heron.server.settings import CorsOptions, HttpOptions, OpenAIOptions
    from heron.entrypoints.serve_options import load_chat_template

    model = args.model_path or args.model
    names = args.served_model_name or [model or DEFAULT_MODEL_NAME]
    openai = OpenAIOptions(
        model_aliases=tuple(names[1:]), response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_logprobs=args.max_logprobs, chat_template=load_chat_template(args.chat_template),
        sampling_defaults=sampling_defaults(args.generation_config, model,
                                            args.override_generation_config),
        log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats)
    cors = None
    if args.allowed_origins:
        cors = CorsOptions(tuple(args.allowed_origins), tuple(args.allowed_methods or ["*"]),
                           tuple(args.allowed_headers or ["*"]), args.allow_credentials)
    http = HttpOptions(docs=not args.disable_fastapi_docs, root_path=args.root_path.rstrip("/"),
                       cors=cors, uvicorn_log_level=args.uvicorn_log_level,
                       ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                       ssl_ca_certs=args.ssl_ca_certs, body_timeout_s=args.request_body_timeout)
    return ServerSettings(
        served_model_name=names[0], api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_queued_sequences=args.max_queued_sequences,
        max_sequences_per_request=args.max_sequences_per_request,
        max_body_bytes=args.max_body_bytes, cost_per_gpu_hour=args.cost_per_gpu_hour,
        shutdown_timeout=args.shutdown_timeout, openai=openai, http=http,
        kv_events_endpoint=args.kv_events_endpoint)


def _check_device(device: str) -> None:
    if device == "auto":
        return
    import torch

    actual = "cuda" if torch.cuda.is_available() else "cpu"
    if device != actual:
        hint = ("hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU" if actual == "cuda"
                else "torch sees no CUDA GPU here")
        raise ValueError(f"--device {device}: heron runs on {actual} on this machine; {hint}")


def _tokenizer_dir(tokenizer: str | None) -> str | None:
    from pathlib import Path

    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"--tokenizer {tokenizer}: not a directory (heron does not "
                                f"download: give a local directory with the tokenizer files)")
    return tokenizer


def _log_choices(args, settings) -> None:
    from heron.entrypoints.vllm_flags import log_notes

    log_notes(args)
    if args.trust_remote_code:
        logger.info("--trust-remote-code is not needed: heron implements each architecture "
                    "itself and never runs code from the model directory")
    if settings.openai.sampling_defaults:
        logger.info("sampling defaults for requests that leave them unset (from "
                    "--generation-config / --override-generation-config): %s",
                    settings.openai.sampling_defaults)


def run(args) -> int:
    from heron.server.launcher import run

    config = engine_config(args)
    settings = server_settings(args)
    _log_choices(args, settings)
    if config.parallel.node_rank > 0:
        from heron.executor.multiproc import run_node_ranks

        return run_node_ranks(config)  # this node's ranks; node 0 serves
    return run(config, settings, args.host, args.port)
