"""Sampling math: logits of a batch of rows -> next tokens and logprobs.

Shared by the worker's plain sampling and speculative decoding's verification, so both apply
the same processing to a row. A row is anything shaped like ``rows.SamplingRow`` (the
worker's ``SequenceState``, a verified draft position).

- ``processing``: raw logprobs, then penalties and min_tokens masking (in logit space);
- ``filters``: temperature, top-k, top-p, min-p -> probabilities;
- ``draw``: one token per row from probabilities (seeded rows from their own generator);
- ``logprobs``: the reported logprobs of one position;
- ``sampler``: ``Sampler``, the whole pipeline for one token per row.
"""
