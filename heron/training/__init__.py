"""Training tools that sit on top of the engine: ``heron train-draft`` (an EAGLE head for
speculative decoding, trained on the target's own generations). It uses the offline ``LLM``
to generate data, so it lives above ``heron.entrypoints``; the head itself and its
checkpoint format are in ``heron.speculative``."""
