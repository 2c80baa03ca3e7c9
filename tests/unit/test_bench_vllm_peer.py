"""The vLLM peer's plumbing (own process, replies on their own pipe), with a stand-in `vllm`
package: the real one lives in .venv/peers/vllm and is too large to install in CI."""

from __future__ import annotations

import sys
import textwrap

from heron.bench.throughput import run_engine
from heron.bench.vllm_peer import VLLMPeer
from heron.bench.workloads import Sample

FAKE_VLLM = '''
import sys
from types import SimpleNamespace

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, model, **kwargs):
        print("fake vLLM loading", model, kwargs)  # vLLM's chatter must not corrupt replies
        self.kwargs = kwargs

    def generate(self, prompts, params, use_tqdm=False):
        return [SimpleNamespace(outputs=[SimpleNamespace(
                    token_ids=[p["prompt_token_ids"][-1]] * sp.max_tokens)])
                for p, sp in zip(prompts, params)]
'''


def test_vllm_peer_round_trip(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (tmp_path / "vllm" / "inputs.py").write_text("TokensPrompt = dict\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    peer = VLLMPeer(tmp_path, "float32", 256, 8, 64, python=sys.executable)
    try:
        samples = [Sample([5, 6, 7], 4), Sample([9], 2)]
        record, outputs = run_engine(peer, samples, [Sample([1], 1)])
        assert outputs == [[7, 7, 7, 7], [9, 9]]
        assert record["output_tokens"] == 6 and record["elapsed_s"] >= 0
    finally:
        peer.close()
    assert peer.proc.returncode == 0
