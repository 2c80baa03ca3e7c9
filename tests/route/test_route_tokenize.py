"""The router's torch-free tokenizer gives exactly the ids `heron serve` computes.

- SmolLM2's tokenizer (the embedded default model's, written by ``prepare_gguf_tokenizer_dir``,
  here in a tiny served model that starts in seconds) against a live worker's POST /tokenize,
  found through its GET /server_info, on prompts and chats;
- Gemma 3's tokenizer (a BOS-adding post-processor, a template that raises on bad roles) and
  a tiny hand-built tokenizer (its own template: bos_token, tojson, loop controls,
  {% generation %}) against transformers in-process, the library the worker uses;
- importing the router's tokenizer and policy loads neither torch nor transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from heron.route.tokenize import ChatTemplateError, RouteTokenizer, request_token_ids
from server_fixture import HeronServer

PROMPTS = ["Hello world", "", "  two  spaces\n\nand a <|im_start|> special token",
           "héllo 日本語 🙂 \t tabs", "The capital of France is" * 20]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2 🙂"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": "part two"}]}],
]


@pytest.fixture(scope="module")
def worker(served_model):
    srv = HeronServer(served_model, "--disable-log-requests")
    yield srv
    assert srv.stop() == 0


def _worker_ids(worker, body: dict) -> list[int]:
    r = httpx.post(f"{worker.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_matches_the_workers_tokenize_on_prompts_and_chats(worker):
    info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
    tok = RouteTokenizer.from_dir(info["tokenizer_dir"], info["chat_template"])
    for prompt in PROMPTS:
        assert tok.encode_prompt(prompt) == _worker_ids(worker, {"prompt": prompt}), prompt
        assert request_token_ids(tok, "completions", {"prompt": [prompt, "x"]}) \
            == _worker_ids(worker, {"prompt": prompt})
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            body = {"messages": chat, "add_generation_prompt": add_generation_prompt}
            assert request_token_ids(tok, "chat", body) == _worker_ids(worker, body), body


def test_token_id_prompts_pass_through_and_bad_bodies_give_none(worker):
    info = httpx.get(f"{worker.url}/server_info", timeout=10).json()
    tok = RouteTokenizer.from_dir(info["tokenizer_dir"])
    assert request_token_ids(tok, "completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert request_token_ids(tok, "completions", {"prompt": [[1, 2], [3]]}) == [1, 2]
    assert request_token_ids(tok, "completions", {}) is None
    assert request_token_ids(tok, "chat", {"messages": []}) is None


def _hf_chat_ids(hf, chat, add_generation_prompt):
    ids = hf.apply_chat_template(chat, tokenize=True,
                                 add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _check_against_transformers(tokenizer_dir, chats):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok = RouteTokenizer.from_dir(tokenizer_dir)
    for prompt in PROMPTS:
        assert tok.encode_prompt(prompt) == hf(prompt).input_ids, prompt
    for chat in chats:
        for add_generation_prompt in (True, False):
            assert tok.encode_chat(chat, add_generation_prompt) \
                == _hf_chat_ids(hf, chat, add_generation_prompt), chat
    return tok


def test_gemma3_tokenizer_matches_transformers():
    from heron.loader.gguf_loader import prepare_gguf_tokenizer_dir
    from heron.loader.packaged_gguf import find_gemma3_270m_gguf

    try:
        gguf = find_gemma3_270m_gguf()
    except RuntimeError as e:
        pytest.skip(str(e))
    tok = _check_against_transformers(prepare_gguf_tokenizer_dir(gguf), [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]])
    assert tok.encode_prompt("x")[0] == 2  # Gemma's post-processor adds <bos>
    with pytest.raises(ChatTemplateError):  # its template's raise_exception on role order
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


def _tiny_tokenizer_dir(path):
    """A word-level tokenizer with a BOS-adding post-processor and its own chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "USER", "A", ":", '"', "hi", "there", "<", ">", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"\w+|[^\w\s]|\n", behavior="isolated")
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TINY_TEMPLATE}))
    return path


def test_tiny_tokenizer_matches_transformers(tmp_path):
    tok = _check_against_transformers(_tiny_tokenizer_dir(tmp_path), [
        [{"role": "user", "content": "hi <there>"}],
        [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"},
         {"role": "assistant", "content": "there"}]])
    assert tok.render_chat([{"role": "user", "content": "<hi>"}]) \
        == '<s>USER: "<hi>"A:'  # tojson does not HTML-escape; trim_blocks ate the newline


def test_router_tokenizer_and_policy_import_neither_torch_nor_transformers():
    code = ("import sys; import heron.route.tokenize, heron.route.policies.cache_aware; "
            "heron.route.tokenize.compile_template('{{ 1 }}'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _random_chat_texts(specials: list[str], n: int = 200) -> list[str]:
    import random

    rng = random.Random(0)
    atoms = [*specials, " ", "\n", "\n\n", "hello", " world", "system", "user\n", "12345",
             "日本", "🙂", "  ", "\t", "don't", "<", "|", "im_start", "x" * 70]
    return [("You are a long system prompt. " * 3 if i % 2 else "")
            + "".join(rng.choice(atoms) for _ in range(rng.randrange(0, 30))) for i in range(n)]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_piecewise_encoding_equals_whole_text_encoding(model):
    from tokenizers import Tokenizer

    from heron.loader.gguf_loader import find_default_gguf, prepare_gguf_tokenizer_dir
    from heron.route.segment_encoder import segment_encoder

    if model == "gemma3":
        from heron.loader.packaged_gguf import find_gemma3_270m_gguf

        try:
            gguf = find_gemma3_270m_gguf()
        except RuntimeError as e:
            pytest.skip(str(e))
    else:
        gguf = find_default_gguf()
    tokenizer = Tokenizer.from_file(str(prepare_gguf_tokenizer_dir(gguf) / "tokenizer.json"))
    pieces = segment_encoder(tokenizer)
    assert pieces is not None
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values()][:8]
    for text in _random_chat_texts(specials) * 2:  # the second round from the cache
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
    assert pieces.enabled


def test_piecewise_encoding_stays_off_where_it_could_differ():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from heron.route.segment_encoder import segment_encoder

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert segment_encoder(tok) is None  # the first piece is special to Metaspace
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", lstrip=True)])
    assert segment_encoder(tok) is None  # "<s>" eats the spaces before it
