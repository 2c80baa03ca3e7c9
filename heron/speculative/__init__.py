"""Speculative decoding: a proposer drafts tokens after a step, the next step verifies them.

Below the worker, above the sampling math and the loader. The runner talks to it only
through ``interface`` (what a proposer may read of a step, what it returns).

- ``interface``: ``StepView``, ``DraftContext``, the ``Proposer`` protocol;
- ``factory``: ``load_draft`` (the draft ``--speculative-config`` names), ``make_proposer``;
- ``ngram``: prompt lookup (``NgramProposer``);
- ``drafter``: ``ModelDrafter``, a draft model decoding on the target's block tables;
- ``draft_models``: layer-skip, separate and EAGLE drafts behind one small interface;
- ``eagle_head`` / ``eagle_checkpoint`` / ``dense_attention``: the EAGLE head, its saved
  format, and the KV-free attention ``heron train-draft`` trains it with;
- ``tree``: ``DraftTree``, a static tree of candidates and its layout in a verifying step;
- ``verify_chain`` / ``verify_tree`` (with ``draft_row``): acceptance, greedy and lossless
  rejection sampling, over ``heron.sample``'s processing;
- ``stats``: acceptance counters (vLLM's ``spec_decode_*``).

This file imports nothing: ``heron.speculative.stats`` is read by the API process, which
loads no torch.
"""
