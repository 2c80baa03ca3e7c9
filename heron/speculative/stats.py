"""Speculative decoding counters (vLLM's ``spec_decode_*`` metrics), kept by the scheduler
as it applies each step's verified drafts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # sequences-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts whose token at position i (0-based) was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence verified ``num_draft_tokens`` drafts and accepted the first
        ``num_accepted`` of them."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per sequence: accepted drafts plus the bonus."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, before: SpecDecodingStats) -> SpecDecodingStats:
        """The counts between an earlier snapshot ``before`` and this one."""
        old = before.accepted_per_pos
        return SpecDecodingStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [n - (old[i] if i < len(old) else 0) for i, n in enumerate(self.accepted_per_pos)])

    def summary(self) -> dict:
        """Counts, acceptance rate, mean acceptance length, and the accepted fraction of
        drafts at each position."""
        drafts = self.num_drafts
        return {"num_drafts": drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_per_pos_rate": [round(n / drafts, 3) if drafts else 0.0
                                          for n in self.accepted_per_pos]}
