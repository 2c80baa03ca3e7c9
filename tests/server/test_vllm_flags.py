"""`heron serve` takes vLLM's command lines: each flag is accepted (and lands in the right
setting) or refused in one line that names heron's equivalent or says why it does not apply.

The command lines are the kind vLLM's docs and deployments pass (model names are parsed, not
loaded). One real server then runs with several of the flags and is checked over HTTP.
"""

from __future__ import annotations

import json
import shlex
import socket

import httpx
import pytest
import torch

from heron.entrypoints.cli import build_parser
from heron.entrypoints.serve_cli import engine_config, server_settings
from heron.entrypoints.serve_options import resolve_dtype
from heron.server.generation_defaults import sampling_defaults
from heron.server.protocol import ChatCompletionRequest, CompletionRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def parse(line: str):
    """``vllm serve ...`` as `heron serve` reads it: (args, EngineConfig, ServerSettings)."""
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"]
    args = build_parser().parse_args(["serve", *argv[2:]])
    return args, engine_config(args), server_settings(args)


ACCEPTED = [
    ("vllm serve meta-llama/Llama-3.1-8B-Instruct --dtype auto --api-key token-abc123",
     lambda a, c, s: (c.dtype, s.api_key, s.served_model_name) == (
         "float32" if DEVICE == "cpu" else "bfloat16", "token-abc123",
         "meta-llama/Llama-3.1-8B-Instruct")),
    ("vllm serve Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 --port 8001 --max-model-len 4096 "
     "--gpu-memory-utilization 0.9 --max-num-seqs 64 --tensor-parallel-size 1 --enforce-eager",
     lambda a, c, s: (a.host, a.port, c.max_model_len, c.cache.memory_fraction,
                      c.scheduler.max_num_seqs, c.parallel.tensor_parallel_size,
                      c.enforce_eager) == ("0.0.0.0", 8001, 4096, 0.9, 64, 1, True)),
    ("vllm serve m --served-model-name gpt-4o gpt-4o-mini --response-role assistant "
     "--chat-template '{% for m in messages %}{{ m.content }}{% endfor %}'",
     lambda a, c, s: (s.served_model_name, s.openai.model_aliases, s.openai.response_role,
                      s.openai.chat_template) == (
         "gpt-4o", ("gpt-4o-mini",), "assistant",
         "{% for m in messages %}{{ m.content }}{% endfor %}")),
    ("vllm serve m --enable-prefix-caching --enable-chunked-prefill "
     "--max-num-batched-tokens 8192 --disable-log-requests --disable-log-stats "
     "--uvicorn-log-level info",
     lambda a, c, s: (c.cache.enable_prefix_caching, c.scheduler.max_num_batched_tokens,
                      s.openai.log_requests, s.openai.log_stats,
                      s.http.uvicorn_kwargs()["log_level"], s.http.uvicorn_kwargs()[
                          "access_log"]) == (True, 8192, False, False, "info", True)),
    ("vllm serve m --no-enable-prefix-caching --seed 42 --swap-space 4 --kv-cache-dtype auto "
     "--load-format safetensors --trust-remote-code --tokenizer-mode auto",
     lambda a, c, s: (c.cache.enable_prefix_caching, c.seed, c.load_format,
                      a.trust_remote_code, len(a.vllm_notes)) == (False, 42, "auto", True, 2)),
    ("vllm serve m --no-prefix-cache --load-format dummy --enable-log-requests",
     lambda a, c, s: (c.cache.enable_prefix_caching, c.load_format,
                      s.openai.log_requests) == (False, "dummy", True)),
    ("vllm serve m --generation-config vllm --override-generation-config "
     "'{\"temperature\": 0.6, \"top_p\": 0.95}' --max-logprobs 5 --return-tokens-as-token-ids",
     lambda a, c, s: (s.openai.sampling_defaults, s.openai.max_logprobs,
                      s.openai.return_tokens_as_token_ids) == (
         {"temperature": 0.6, "top_p": 0.95}, 5, True)),
    ("vllm serve m --allowed-origins '[\"https://app.example\"]' "
     "--allowed-methods '[\"GET\", \"POST\"]' --allowed-headers '[\"*\"]' --allow-credentials "
     "--root-path /llm/ --disable-fastapi-docs --ssl-keyfile k.pem --ssl-certfile c.pem",
     lambda a, c, s: (s.http.cors.allowed_origins, s.http.cors.allowed_methods,
                      s.http.cors.allow_credentials, s.http.root_path, s.http.docs,
                      s.http.uvicorn_kwargs()["ssl_certfile"]) == (
         ("https://app.example",), ("GET", "POST"), True, "/llm", False, "c.pem")),
    ("vllm serve m --dtype bfloat16 --quantization fp8 --max-num-seqs 8 -pp 2 "
     f"--device {DEVICE} --disable-custom-all-reduce --max-log-len 100",
     lambda a, c, s: (c.dtype, c.quantization, c.parallel.pipeline_parallel_size) == (
         "bfloat16", "fp8", 2)),
    ("vllm serve m", lambda a, c, s: (
        c.cache.enable_prefix_caching, s.openai.log_requests, s.openai.max_logprobs,
        s.http.cors, s.http.docs) == (True, True, 20, None, True)),
]


@pytest.mark.parametrize("line,check", ACCEPTED, ids=[line[:60] for line, _ in ACCEPTED])
def test_vllm_command_lines_are_accepted_into_the_right_settings(line, check):
    assert check(*parse(line))


REFUSED = [
    ("--lora-modules sql-lora=/adapters/sql", "merge the adapter"),
    ("--enable-lora --max-lora-rank 64", "merge the adapter"),
    ("--enable-auto-tool-choice --tool-call-parser hermes", "tool calling is not supported"),
    ("--tool-call-parser llama3_json", "tool calling is not supported"),
    ("--reasoning-parser deepseek_r1", "reasoning"),
    ("--guided-decoding-backend xgrammar", "structured outputs"),
    ("--download-dir /data/hf", "does not download"),
    ("--revision main", "does not download"),
    ("--kv-cache-dtype fp8", "model's dtype (--dtype)"),
    ("--no-enable-chunked-prefill", "--max-num-batched-tokens"),
    ("-dp 2", "one heron serve per replica"),
    ("--data-parallel-size 2", "one heron serve per replica"),
    ("--num-gpu-blocks-override 100", "--num-kv-blocks"),
    ("--cpu-offload-gb 4", "quantize"),
    ("--speculative-model ngram --num-speculative-tokens 4", "--speculative-config"),
    ("--tokenizer-mode mistral", "tokenizer"),
    ("--config serve.yaml", "flags only"),
    ("--load-format pt", "safetensors and GGUF"),
    ("--quantization bitsandbytes", "choose from"),
]


@pytest.mark.parametrize("flags,hint", REFUSED, ids=[f for f, _ in REFUSED])
def test_vllm_flags_heron_lacks_are_refused_naming_the_alternative(flags, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(f"vllm serve m {flags}")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("heron serve: error: ") and hint in err[-1], err
    if "choose from" not in hint and "safetensors" not in hint:  # ours: one line, no usage
        assert len(err) == 1, err


@pytest.mark.parametrize("flags,message", [
    ("--max-logprobs 21", "--max-logprobs must be in [0, 20]"),
    ("--override-generation-config '{\"beam_width\": 2}'", "unknown key(s) beam_width"),
    ("--chat-template ./no/such/template.jinja", "looks like a file path"),
    ("--chat-template '{% for m in messages %}'", "not a valid Jinja template"),
    ("--generation-config /no/such/dir", "no such folder"),
    ("--tokenizer /no/such/tokenizer", "not a directory"),
    ("--ssl-keyfile k.pem", "--ssl-keyfile and --ssl-certfile go together"),
    ("--device " + ("cpu" if DEVICE == "cuda" else "cuda"), "heron runs on " + DEVICE),
])
def test_bad_values_fail_before_the_engine_starts(flags, message):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        parse(f"vllm serve m {flags}")
    assert message in str(err.value)


@pytest.mark.parametrize("flags,message", [
    ("--shutdown-timeout -1", "must be zero or more seconds"),
    ("--shutdown-timeout inf", "must be zero or more seconds"),
    ("--request-body-timeout soon", "is not a number of seconds"),
])
def test_durations_are_checked(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(f"vllm serve m {flags}")
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_help_reads_prefix_caching_the_right_way_round():
    serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in serve_help
    assert "(default: True)" not in serve_help and "--no-prefix-cache" not in serve_help


def test_dtype_auto_follows_the_checkpoint_on_cuda_and_is_float32_on_cpu(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert resolve_dtype("auto", str(tmp_path), on_cuda=True)[0] == "float16"
    assert resolve_dtype("auto", str(tmp_path), on_cuda=False)[0] == "float32"
    assert resolve_dtype("auto", "model.gguf", on_cuda=True)[0] == "bfloat16"
    assert resolve_dtype("bfloat16", str(tmp_path), on_cuda=False) == ("bfloat16", None)


def test_generation_config_defaults_apply_to_unset_fields_only(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_new_tokens": 7,
        "eos_token_id": 2, "do_sample": True}))
    defaults = sampling_defaults("auto", str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.9, "max_tokens": 7}
    assert sampling_defaults("vllm", str(tmp_path)) == {}
    assert sampling_defaults("vllm", str(tmp_path), {"min_p": 0.1}) == {"min_p": 0.1}
    assert sampling_defaults(str(tmp_path), None, {"top_k": 5})["top_k"] == 5
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    p = chat.to_sampling_params(None, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 0.5, 7)
    p = CompletionRequest(prompt="hi", max_tokens=3, temperature=0).to_sampling_params(
        None, defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 3)
    assert CompletionRequest(prompt="hi").to_sampling_params(None, defaults).max_tokens == 7
    assert CompletionRequest(prompt="hi").to_sampling_params(None).max_tokens == 16


# ---- one real server with vLLM's flags --------------------------------------------------
@pytest.fixture(scope="module")
def server_args(served_model, tmp_path_factory):
    gen = tmp_path_factory.mktemp("generation-config")
    (gen / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 5}))
    return (served_model, "--served-model-name", "smol", "other", "--max-logprobs", "2",
            "--allowed-origins", '["http://ok.example"]', "--response-role", "helper",
            "--return-tokens-as-token-ids", "--generation-config", str(gen),
            "--disable-log-requests", "--swap-space", "4", "--dtype", "auto",
            "--enable-prefix-caching", "--trust-remote-code",
            "--uvicorn-log-level", "warning", "--request-body-timeout", "1",
            "--chat-template", "<<{% for m in messages %}{{ m.content }}|{% endfor %}>>")


def _chat(server, **body) -> httpx.Response:
    body = {"model": "other", "messages": [{"role": "user", "content": "Hi"}],
            "ignore_eos": True, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_served_names_model_404_and_response_role(server):
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["smol", "other"]
    r = _chat(server)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "smol" and out["choices"][0]["message"]["role"] == "helper"
    assert out["usage"]["completion_tokens"] == 5  # max_new_tokens of generation_config.json
    r = _chat(server, model="not-smol")
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "The model `not-smol` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    assert _chat(server, model=None).status_code == 200  # no model: served (as vLLM)
    log = server.log_tail(1_000_000)
    assert "heron serving smol" in log and " done: prompt=" not in log  # --disable-log-requests
    assert "--swap-space is ignored" in log and "--trust-remote-code is not needed" in log


def test_generation_config_defaults_reach_requests(server):
    """top_k 1 from the generation config makes sampling greedy whatever the seed; a request
    that sets top_k itself samples (random weights: two seeds differ)."""
    greedy = _chat(server, temperature=0, max_tokens=5).json()["choices"][0]["message"]
    seeded = [_chat(server, seed=s).json()["choices"][0]["message"] for s in (1, 2)]
    assert seeded == [greedy, greedy]
    own = [_chat(server, seed=s, top_k=0).json()["choices"][0]["message"]["content"]
           for s in (1, 2)]
    assert own[0] != own[1]


def test_max_logprobs_and_token_ids(server):
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 3}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 2}, timeout=60)
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"] for k in top)
    r = _chat(server, logprobs=True, top_logprobs=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_cors_and_csrf_over_http(server):
    preflight = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(f"{server.url}/v1/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ok.example"
    r = httpx.options(f"{server.url}/v1/completions",
                      headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = httpx.head(f"{server.url}/v1/models")
    assert r.status_code == 200 and r.content == b""


def _raw(server, request: bytes) -> bytes:
    """Send ``request``; what the server answers before it closes the connection (10 s)."""
    data = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        for _ in range(100):  # bounded: the server closes the connection after its answer
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_framing_and_stalled_bodies_through_uvicorn(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    both = head + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    answer = _raw(server, both)  # returns: the server closed the connection
    assert answer.startswith(b"HTTP/1.1 400") and b"connection: close" in answer.lower()
    stalled = _raw(server, head + b"Content-Length: 100\r\n\r\n{")  # 99 bytes never come
    assert stalled.startswith(b"HTTP/1.1 408"), stalled[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_template_flag_replaces_the_tokenizers(server):
    def tokens(**body):
        r = httpx.post(f"{server.url}/tokenize", json={"model": "smol", **body}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert tokens(messages=messages) == tokens(prompt="<<Hi|Yo|>>", add_special_tokens=False)
