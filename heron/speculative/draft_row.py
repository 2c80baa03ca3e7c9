"""One verified row of a sequence, as the sampling functions see it."""

from __future__ import annotations

from dataclasses import dataclass

from heron.sample.rows import SamplingRow


@dataclass(eq=False)
class DraftRow:
    """A sequence as one verified row sees it: its tokens plus the drafts before the row
    (what the penalties and min_tokens count). A ``SamplingRow``."""

    state: SamplingRow
    drafts: list[int]

    params = property(lambda self: self.state.params)
    eos_token_ids = property(lambda self: self.state.eos_token_ids)
    generator = property(lambda self: self.state.generator)

    @property
    def output_token_ids(self) -> list[int]:
        return self.state.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.state.num_output_tokens + len(self.drafts)

    def all_token_ids(self) -> list[int]:
        return self.state.all_token_ids() + self.drafts
