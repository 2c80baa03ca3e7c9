"""Speculative decoding's verification is lossless: tokens emitted with drafts are distributed
exactly as the target's own sampling, and greedy verification is exact.

The distribution tests compare empirical distributions with the exact target distribution in
L1 distance. For n samples over V outcomes, P(||p_hat - p||_1 >= eps) <= (2^V - 2)
exp(-n eps^2 / 2) (Weissman et al. 2003), so ``_l1_bound`` picks the eps of a false-alarm
rate of 1e-6 per check. A deliberately broken acceptance rule must fail the same checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from heron.sampling_params import SamplingParams
from heron.speculative import verify_chain
from heron.worker.input_batch import SequenceState
from heron.speculative.verify_chain import verify
from heron.sample.sampler import Sampler

FALSE_ALARM = 1e-6
VOCAB = 6


def _l1_bound(n: int, vocab: int = VOCAB) -> float:
    return math.sqrt(2 * (math.log(2 ** vocab - 2) + math.log(1 / FALSE_ALARM)) / n)


def _state(i: int, params: SamplingParams, output=()) -> SequenceState:
    return SequenceState(f"s{i}", i, [1, 2, 3], params, (), None, list(output))


def _target_logits(k: int, seed: int = 0) -> torch.Tensor:
    """(k + 1, VOCAB) logits: row j is the target after j drafts."""
    return torch.randn(k + 1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def _sample_many(logits, drafts, n, draft_probs=None, params=None, seed=0):
    """Emitted token lists of ``n`` independent sequences verifying ``drafts`` (a list per
    sequence, or one for all) on ``logits`` (every sequence sees the same rows: a target
    whose next-token distribution at row j does not depend on the tokens before)."""
    params = params or SamplingParams(temperature=1.0)
    states = [_state(i, params) for i in range(n)]
    rows = logits.repeat(n, 1)
    per_sequence = drafts if isinstance(drafts[0], list) else [list(drafts)] * n
    probs = None if draft_probs is None else [draft_probs] * n
    return verify(rows, states, per_sequence, torch.Generator().manual_seed(seed),
                  probs).token_ids


def _empirical(tokens: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB)
    return counts.double() / max(1, len(tokens))


def _check_position(emitted, logits, drafts, j, temperature=1.0):
    """Among sequences whose first j tokens are their drafts, the (j+1)-th token ~ p_j."""
    if not isinstance(drafts[0], list):
        drafts = [list(drafts)] * len(emitted)
    follow = [t[j] for t, d in zip(emitted, drafts) if len(t) > j and t[:j] == d[:j]]
    want = (logits[j].double() / temperature).softmax(-1)
    distance = float((_empirical(follow) - want).abs().sum())
    return distance, _l1_bound(len(follow)), len(follow)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_emitted_tokens_follow_the_target_distribution(with_draft_probs):
    k, n = 3, 20000
    logits = _target_logits(k)
    # deterministic drafts: the target's likeliest token at each row, then an unlikely one
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[2].argmin())]
    draft_probs = None
    if with_draft_probs:  # a proposer that samples its drafts from q: accept min(1, p/q)
        draft_probs = torch.rand(k, VOCAB, generator=torch.Generator().manual_seed(1)) + 0.1
        draft_probs /= draft_probs.sum(-1, keepdim=True)
        drafts = torch.multinomial(draft_probs, n, replacement=True,
                                   generator=torch.Generator().manual_seed(2)).T.tolist()
    emitted = _sample_many(logits, drafts, n, draft_probs)
    assert all(1 <= len(t) <= k + 1 for t in emitted)
    for j in range(k):
        distance, bound, count = _check_position(emitted, logits, drafts, j)
        assert count > 1000, f"too few samples reach position {j}"
        assert distance < bound, f"position {j}: L1 {distance:.4f} >= {bound:.4f} ({count})"


@pytest.mark.parametrize("broken", ["residual_keeps_draft", "accept_if_likely"])
def test_a_broken_acceptance_rule_fails_the_same_check(monkeypatch, broken):
    k, n = 3, 20000
    logits = _target_logits(k)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[2].argmin())]
    if broken == "residual_keeps_draft":  # draws from p instead of p without the draft
        monkeypatch.setattr(verify_chain, "_residual", lambda p, rejected, q: p)
    else:  # accepts every draft the target finds likely enough (biased towards drafts)
        original = verify_chain._uniforms

        def biased(states, drafts_, sampling, generator):
            return {i: [u * 0.5 for u in us]
                    for i, us in original(states, drafts_, sampling, generator).items()}
        monkeypatch.setattr(verify_chain, "_uniforms", biased)
    emitted = _sample_many(logits, drafts, n)
    distance, bound, _ = _check_position(emitted, logits, drafts, 0)
    assert distance > bound, f"the broken rule {broken} passed: L1 {distance:.4f} < {bound:.4f}"


def test_filters_apply_to_both_distributions():
    """top-k and temperature shape p_j; emitted tokens follow the filtered target."""
    k, n = 2, 20000
    logits = _target_logits(k, seed=3)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    params = SamplingParams(temperature=0.7, top_k=3)
    emitted = _sample_many(logits, drafts, n, params=params)
    for j in range(k):
        follow = [t[j] for t in emitted if len(t) > j and t[:j] == drafts[:j]]
        scaled = logits[j].double() / 0.7
        keep = scaled.topk(3).indices
        want = torch.zeros(VOCAB, dtype=torch.double)
        want[keep] = scaled[keep].softmax(-1)
        distance = float((_empirical(follow) - want).abs().sum())
        assert distance < _l1_bound(len(follow)), f"position {j}"


def test_greedy_verification_is_exact_under_penalties():
    """Greedy: accepted drafts are the tokens one-at-a-time decoding would pick, with the
    repetition penalty counting the drafts before each row."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.5)
    logits = torch.randn(4, 50)
    state = _state(0, params, output=[7, 8])
    sampler = Sampler(0)
    expected, sequence = [], []
    for j in range(4):  # what sequential decoding picks after the drafts so far
        probe = _state(0, params, output=[7, 8] + sequence)
        token = sampler(logits[j:j + 1].clone(), [probe]).token_ids[0]
        expected.append(token)
        sequence.append(token)
    drafts = expected[:2] + [(expected[2] + 1) % 50]  # the third draft is wrong
    out = verify(logits, [state], [drafts], torch.Generator().manual_seed(0)).token_ids[0]
    assert out == expected[:3]


def test_seeded_sequences_repeat_and_logprobs_cover_every_token():
    logits = _target_logits(3, seed=5)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[2].argmax())]
    params = SamplingParams(temperature=1.0, seed=11, logprobs=2)

    def run():
        state = _state(0, params)
        state.generator = torch.Generator().manual_seed(11)
        return verify(logits.clone(), [state], [drafts], torch.Generator().manual_seed(0))

    first, second = run(), run()
    assert first.token_ids == second.token_ids
    tokens, logprobs = first.token_ids[0], first.logprobs[0]
    assert len(logprobs) == len(tokens)
    raw = logits.log_softmax(-1)
    for j, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert entry[token][0] == pytest.approx(float(raw[j, token]), abs=1e-6)


def test_sequences_without_drafts_sample_as_the_plain_sampler():
    """k = 0 in a verifying step: the same token as the ordinary sampler, seed for seed."""
    logits = _target_logits(0, seed=9)
    params = SamplingParams(temperature=0.9, seed=4)
    plain = _state(0, params)
    plain.generator = torch.Generator().manual_seed(4)
    want = Sampler(0)(logits.clone(), [plain]).token_ids[0]
    spec = _state(0, params)
    spec.generator = torch.Generator().manual_seed(4)
    got = verify(logits.clone(), [spec], [[]], torch.Generator().manual_seed(0)).token_ids[0]
    assert got == [want]


TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]"


def _tree_samples(n: int, seed: int = 0, broken: bool = False, monkeypatch=None):
    """Emitted tokens of ``n`` sequences verifying one fixed tree on fixed rows."""
    from heron.speculative import verify_tree
    from heron.speculative.tree import DraftTree

    tree = DraftTree.parse(TREE)
    logits = torch.randn(tree.num_nodes + 1, VOCAB,
                         generator=torch.Generator().manual_seed(seed)) * 1.5
    ranked = [logits[0].argsort(descending=True).tolist(),
              logits[1].argsort(descending=True).tolist(),
              logits[4].argsort(descending=True).tolist()]
    nodes = tree.tokens_from_choices(ranked)
    if broken:  # forgets to remove a rejected sibling from p before trying the next one
        monkeypatch.setattr(verify_tree, "_walk_sampled", _walk_without_removal)
    params = SamplingParams(temperature=1.0)
    states = [_state(i, params) for i in range(n)]
    out = verify_tree.verify_tree(logits.repeat(n, 1), states, [nodes] * n, tree,
                                  torch.Generator().manual_seed(seed))
    return logits, nodes, out


def _walk_without_removal(start, nodes, children, targets, probs, state, generator):
    p = probs[start]
    for child in children[0]:
        if float(torch.rand(1, generator=generator)) < float(p[nodes[child]]):
            return [child], [start], [nodes[child]]
    token = int(torch.multinomial(p, 1, generator=generator))
    return [], [start], [token]


def test_tree_verification_is_lossless():
    n = 20000
    logits, nodes, out = _tree_samples(n)
    first = [t[0] for t in out.token_ids]
    want = logits[0].double().softmax(-1)
    assert float((_empirical(first) - want).abs().sum()) < _l1_bound(n)
    # after the top candidate (node 0, row 1): the next token follows row 1's distribution
    follow = [t[1] for t in out.token_ids if t[0] == nodes[0]]
    want = logits[1].double().softmax(-1)
    assert float((_empirical(follow) - want).abs().sum()) < _l1_bound(len(follow))
    assert any(p and p[0] in (1, 2) for p in out.paths), "no sibling was ever accepted"


def test_a_broken_tree_rule_fails_the_same_check(monkeypatch):
    n = 20000
    logits, _, out = _tree_samples(n, broken=True, monkeypatch=monkeypatch)
    first = [t[0] for t in out.token_ids]
    want = logits[0].double().softmax(-1)
    assert float((_empirical(first) - want).abs().sum()) > _l1_bound(n)


def test_greedy_tree_follows_the_argmax_through_siblings():
    from heron.speculative.tree import DraftTree
    from heron.speculative.verify_tree import verify_tree

    tree = DraftTree.parse(TREE)
    logits = torch.full((tree.num_nodes + 1, 10), -5.0)
    nodes = [4, 5, 6, 7, 8, 9]  # (0,) (1,) (2,) (0,0) (0,1) (0,0,0)
    logits[0, 5] = 5.0  # the root's argmax is the second candidate, (1,): a leaf
    logits[2, 3] = 5.0  # after (1,) the target wants 3
    out = verify_tree(logits, [_state(0, SamplingParams(temperature=0.0))], [nodes], tree,
                      torch.Generator())
    assert out.token_ids == [[5, 3]] and out.paths == [[1]]
