"""Speculative decoding: proposers draft tokens after a step, the next step verifies them.

Empty on purpose: importing ``heron.speculative.stats`` (the API process does, for the
acceptance metrics) loads no torch.
"""
