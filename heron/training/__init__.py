"""Training tools that sit on top of the engine: ``heron train-draft`` (an EAGLE head for
speculative decoding, trained on the target's own generations). It uses the offline ``LLM``
(``heron.engine.llm``) to generate data, so it sits above the engine and below the command
line that registers it (``heron.entrypoints``); the head itself and its checkpoint format
are in ``heron.speculative``."""
