"""Speculative decoding end to end: greedy output is token-identical with speculation on and
off, for every method and architecture, under chunked prefill, preemption and prefix hits;
seeded sampling repeats; rejected tokens never leak blocks or reach the prefix cache."""

from __future__ import annotations

import json

import pytest

from hf_reference import make_tiny_model
from heron import LLM, SamplingParams
from heron.config import SpeculativeConfig

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
METHODS = ("ngram", "layer_skip", "draft", "eagle")
# repetitive prompts give prompt lookup something to find; tiny random models loop too
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(10, 50)),
           [3, 4, 3, 4, 3, 4, 3], [11, 12, 13, 14] * 6, [40, 41]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    dirs = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"spec-{arch}")
        make_tiny_model(arch, path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def eagle_dirs(tiny_dirs, tmp_path_factory):
    """An untrained EAGLE head per target: its drafts are poor, which is what exercises
    rejection; a trained one only changes how many are accepted."""
    from heron.models import ModelArchConfig
    from heron.speculative.eagle_checkpoint import save_eagle_head
    from heron.speculative.eagle_head import build_eagle_head

    dirs = {}
    for arch, target in tiny_dirs.items():
        cfg = ModelArchConfig.from_hf(json.loads((target / "config.json").read_text()))
        path = tmp_path_factory.mktemp(f"eagle-{arch}")
        save_eagle_head(build_eagle_head(cfg, seed=1), path, {"data": "untrained (test)"})
        dirs[arch] = path
    return dirs


def _spec(method: str, target, eagle_dirs, arch: str, k: int = 3) -> dict:
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "layer_skip":
        spec["num_layers"] = 1
    elif method == "draft":
        spec["model"] = str(target)  # the target as its own draft: every draft accepted
    elif method == "eagle":
        spec["model"] = str(eagle_dirs[arch])
    return spec


def _generate(path, prompts, params=GREEDY, max_model_len=256, **kwargs):
    llm = LLM(str(path), max_model_len=max_model_len, block_size=8, **kwargs)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return outputs, llm.engine.stats()


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    return {arch: _generate(path, PROMPTS, num_kv_blocks=96)[0]
            for arch, path in tiny_dirs.items()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_identical_with_speculation(arch, method, tiny_dirs, eagle_dirs, reference):
    spec = _spec(method, tiny_dirs[arch], eagle_dirs, arch)
    out, stats = _generate(tiny_dirs[arch], PROMPTS, num_kv_blocks=96, speculative_config=spec)
    assert out == reference[arch]
    drafts = stats.spec_decode
    assert drafts.num_draft_tokens > 0, "nothing was drafted"
    if method == "draft":
        assert drafts.acceptance_rate == 1.0  # the target drafting for itself


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_identical_under_chunking_preemption_and_prefix_hits(
        method, tiny_dirs, eagle_dirs, reference):
    arch = "llama"
    spec = _spec(method, tiny_dirs[arch], eagle_dirs, arch, k=4)
    prompts = PROMPTS * 2  # the second copy of each prompt hits the prefix cache
    # a 12-token budget chunks prompts; 20 blocks of 8 tokens cannot hold 10 sequences
    out, stats = _generate(tiny_dirs[arch], prompts, max_model_len=160, num_kv_blocks=20,
                           max_num_batched_tokens=12, speculative_config=spec)
    assert out == reference[arch] * 2
    assert stats.scheduler.num_preemptions > 0
    assert stats.prefix_cache.hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_blocks  # every block came back


def test_speculation_crosses_the_process_boundary(tiny_dirs, reference):
    """With the worker in its own process, drafts travel in the step messages."""
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_dirs["llama"])}
    out, stats = _generate(tiny_dirs["llama"], PROMPTS, num_kv_blocks=96,
                           speculative_config=spec, distributed_executor_backend="mp")
    assert out == reference["llama"]
    assert stats.spec_decode.acceptance_rate == 1.0


def test_seeded_sampling_repeats_with_speculation(tiny_dirs):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, n=2,
                            ignore_eos=True)
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_dirs["llama"])}
    first, _ = _generate(tiny_dirs["llama"], PROMPTS[:3], params, num_kv_blocks=96,
                         speculative_config=spec)
    second, stats = _generate(tiny_dirs["llama"], PROMPTS[:3], params, num_kv_blocks=96,
                              speculative_config=spec)
    assert first == second
    assert all(len(t) == 30 for t in first)
    assert stats.spec_decode.num_accepted_tokens > 0


def test_disable_by_batch_size_turns_speculation_off(tiny_dirs):
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": str(tiny_dirs["llama"]),
            "disable_by_batch_size": 2}
    out, stats = _generate(tiny_dirs["llama"], PROMPTS * 2, num_kv_blocks=96,
                           speculative_config=spec)
    single, single_stats = _generate(tiny_dirs["llama"], PROMPTS[:1], num_kv_blocks=96,
                                     speculative_config=spec)
    assert single_stats.spec_decode.num_draft_tokens > 0  # alone: it speculates
    # ten at once: drafts only once fewer than two are left running
    assert stats.spec_decode.num_drafts < single_stats.spec_decode.num_drafts * 2
    assert single == out[:1]


def test_max_tokens_and_context_bound_the_drafts(tiny_dirs):
    spec = {"method": "draft", "num_speculative_tokens": 6, "model": str(tiny_dirs["llama"])}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out, _ = _generate(tiny_dirs["llama"], PROMPTS, params, num_kv_blocks=96,
                       speculative_config=spec)
    assert all(len(t) == 5 for t in out)
    long_prompt = [list(range(3, 250))]  # 247 tokens of a 256-token context
    out, stats = _generate(tiny_dirs["llama"], long_prompt, GREEDY, num_kv_blocks=96,
                           speculative_config=spec)
    assert len(out[0]) == 256 - 247


@pytest.mark.parametrize("bad, message", [
    ({"method": "medusa"}, "unknown speculative method"),
    ({"method": "draft"}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "k": 3}, "unknown --speculative-config keys"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(bad)


def test_real_smollm2_greedy_is_identical_with_ngram_and_layer_skip(smollm2):
    passage = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    messages = [{"role": "user", "content": "Repeat this code exactly:\n" + passage}]
    prompt = smollm2.apply_chat_template(messages)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = smollm2.generate([prompt], params)[0].outputs[0].token_ids
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 8}):
        llm = LLM(max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=8,
                  speculative_config=spec)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        stats = llm.engine.stats().spec_decode
        assert got == want, spec["method"]
        assert stats.num_draft_tokens > 0
        if spec["method"] == "ngram":
            assert stats.acceptance_rate > 0.3  # copying: most drafts are right
        llm.engine.shutdown()


TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)]"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("method", ["layer_skip", "eagle"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_identical_with_tree_verification(arch, method, backend, tiny_dirs,
                                                    eagle_dirs, reference, monkeypatch):
    """Tree steps: node positions by depth, tree attention, the accepted path's KV moved to
    its positions; siblings must be accepted sometimes, or the move is never exercised."""
    import heron.worker.sampling_strategies as strategies

    accepted_siblings = []
    verify_tree = strategies.verify_tree

    def counting(logits, states, drafts, tree, generator):
        out = verify_tree(logits, states, drafts, tree, generator)
        accepted_siblings.extend(n for p in out.paths for n in p if tree.paths[n][-1])
        return out

    monkeypatch.setattr(strategies, "verify_tree", counting)
    spec = _spec(method, tiny_dirs[arch], eagle_dirs, arch)
    spec["speculative_token_tree"] = TREE
    out, stats = _generate(tiny_dirs[arch], PROMPTS, num_kv_blocks=96,
                           speculative_config=spec, attention_backend=backend)
    assert out == reference[arch]
    assert stats.spec_decode.num_drafts > 0
    if method == "layer_skip":  # (an untrained EAGLE head rarely has the target's token)
        assert accepted_siblings, "no sibling candidate was accepted"


def test_tree_config_is_checked():
    with pytest.raises(ValueError, match="parent must be on the greedy chain"):
        SpeculativeConfig(method="layer_skip", speculative_token_tree="[(0,), (1,), (1, 0)]")
    with pytest.raises(ValueError, match="prompt lookup"):
        SpeculativeConfig(method="ngram", speculative_token_tree="[(0,)]")
    spec = SpeculativeConfig(method="layer_skip", speculative_token_tree=TREE)
    assert spec.num_speculative_tokens == 3 and len(spec.tree_paths) == 7

