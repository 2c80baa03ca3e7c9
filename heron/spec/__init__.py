"""Speculative decoding's proposers: what drafts the tokens the target then verifies.

``ngram`` (prompt lookup over the sequence's own tokens) and the draft models
(``draft_models``: a smaller model, the target's first layers, an EAGLE head). They know
models and token arrays, not the worker's batch: ``heron.worker.drafter`` runs them after
each step and ``heron.worker.rejection_sampler`` verifies what they drafted.
"""
