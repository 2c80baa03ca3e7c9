"""The OpenAI client against `heron serve` on SmolLM2: outputs equal offline LLM.generate."""

from __future__ import annotations

import asyncio

import openai
import pytest

from heron import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name a color.", "Say hello in French.",
             "What is 2 + 2?"]
GREEDY = dict(temperature=0, max_tokens=16)
MODEL = "SmolLM2-135M-Instruct"  # the served name of the embedded model (others get 404)


@pytest.fixture(scope="module")
def server_args():
    return ("--max-num-seqs", "64")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _offline_chat(smollm2, question: str, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=16, **kw)
    return smollm2.chat([{"role": "user", "content": question}], params)[0].outputs[0].text


def test_models_and_chat_equal_offline(client, smollm2):
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    for q in QUESTIONS[:2]:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], **GREEDY)
        assert resp.choices[0].message.content == _offline_chat(smollm2, q)
        assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 10


def test_completions_stream_and_not_equal_offline(client, smollm2):
    prompt = "The three primary colors are"
    offline = smollm2.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].text
    resp = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    assert resp.choices[0].text == offline
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_async_concurrent_streams_equal_offline(server, smollm2):
    questions = [QUESTIONS[i % 4] + " " * (i // 4) for i in range(32)]
    expected = [_offline_chat(smollm2, q) for q in questions]

    async def one(aclient, q):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], stream=True, **GREEDY)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        return await asyncio.wait_for(asyncio.gather(*(one(aclient, q) for q in questions)), 300)

    assert asyncio.run(main()) == expected


def test_n_stop_logprobs_echo(client, smollm2):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, seed=3,
                                     temperature=1.0, max_tokens=8)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    offline = smollm2.generate(["The capital of France is"],
                               SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    stop = offline.strip().split()[1]
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", stop=[stop],
                                     **GREEDY)
    assert resp.choices[0].text == offline[:offline.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model=MODEL, prompt="Hello world", echo=True, logprobs=2,
                                     max_tokens=3, temperature=0)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith("Hello world")
    assert lp.token_logprobs[0] is None and len(lp.tokens) == 2 + 3
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=3, max_tokens=4)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 3 for e in entries)


def test_streaming_n2_sends_each_finish_once(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=2,
              seed=3, temperature=1.0, max_tokens=40, stop=["e"])
    full = client.chat.completions.create(**kw)
    # the samples stop at different steps: one is finished while the other still streams
    assert len({c.message.content for c in full.choices}) == 2
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert sum(ch.finish_reason is not None for ch in mine) == 1
        text = "".join(ch.delta.content or "" for ch in mine)
        assert text == next(c.message.content for c in full.choices if c.index == index)
