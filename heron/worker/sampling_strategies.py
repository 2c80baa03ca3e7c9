"""How a step turns hidden states into tokens: one strategy per kind of step.

The runner picks one per step: ``PlainSampling`` when no sequence verifies drafts, else the
verification its proposer's drafts need (``ChainVerification``, or ``TreeVerification``
when they are the nodes of a ``DraftTree``). Each strategy lays the step's flat batch out
before the forward (``lay_out``) and samples after it (``sample``, called when some
sequence samples), returning tokens and logprobs by request id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.sample.sampler import Sampler
from heron.speculative.tree import DraftTree
from heron.speculative.verify_chain import verify
from heron.speculative.verify_tree import verify_tree
from heron.worker.batch import HostBatch
from heron.worker.input_batch import SequenceState

# (tokens by request id, logprobs by request id) of the sequences that sampled
Sampled = tuple[dict[str, list[int]], dict[str, list]]


@dataclass
class StepRows:
    """A step's flat batch and the sequences in it, in batch order."""

    batch: HostBatch
    states: list[SequenceState]  # the scheduled sequences
    starts: list[int]  # their num_computed_tokens before the step
    drafts: list[list[int]]  # the drafts each verifies ([] if none)
    sampling: list[int]  # indices of the sequences that sample (reach their end)
    samplers: list[SequenceState]  # states[i] for i in sampling

    @property
    def sampler_drafts(self) -> list[list[int]]:
        """drafts[i] for i in sampling: what each sampling sequence verifies."""
        return [self.drafts[i] for i in self.sampling]


class PlainSampling:
    """One token per sampling sequence, from its last row. Every TP rank computes its slice
    of the logits; the driver samples and, when the TP ranks keep tokens themselves (no
    pipeline: ``tp_broadcast`` is the TP group), broadcasts the tokens to them. With context
    parallelism only CP rank 0 computes logits (``samples``) and, when the CP ranks keep
    tokens (``cp_broadcast``: the CP group), broadcasts them on."""

    def __init__(self, model, sampler: Sampler, tp_broadcast=None, cp_broadcast=None,
                 samples: bool = True) -> None:
        self.model, self.sampler, self.tp_broadcast = model, sampler, tp_broadcast
        self.cp_broadcast, self.samples = cp_broadcast, samples

    def lay_out(self, step: StepRows) -> None:
        """Rows are laid out as the batch state built them."""

    def sample(self, hidden: torch.Tensor, step: StepRows) -> Sampled:
        samplers = step.samplers
        token_ids, logprobs = None, {}
        if self.samples:
            logits = self.model.compute_logits(_rows(hidden, step.batch.sample_rows))
            if logits is not None:  # the driver
                out = self.sampler(logits, samplers)
                token_ids = out.token_ids
                logprobs = {s.req_id: [lp] for s, lp in zip(samplers, out.logprobs)
                            if lp is not None}
            if self.tp_broadcast is not None:
                token_ids = _broadcast(self.tp_broadcast, token_ids, len(samplers),
                                       hidden.device)
        if self.cp_broadcast is not None:
            token_ids = _broadcast(self.cp_broadcast, token_ids, len(samplers), hidden.device)
        if token_ids is None:
            return {}, logprobs
        return {s.req_id: [t] for s, t in zip(samplers, token_ids)}, logprobs


class ChainVerification:
    """Sequences with drafts verify them (``verify_chain``): their tokens are the accepted
    drafts plus one. Runs on one rank (speculative decoding does not shard)."""

    def __init__(self, model, generator: torch.Generator) -> None:
        self.model, self.generator = model, generator

    def lay_out(self, step: StepRows) -> None:
        """A chain's drafts sit at the positions after the sequence, as built."""

    def sample(self, hidden: torch.Tensor, step: StepRows) -> Sampled:
        logits = self.model.compute_logits(_rows(hidden, step.batch.sample_rows))
        out = verify(logits, step.samplers, step.sampler_drafts, self.generator)
        return _by_request(step.samplers, out.token_ids, out.logprobs)


class TreeVerification:
    """Sequences with drafts verify a ``DraftTree`` of candidates in one pass
    (``verify_tree``), then the accepted path's KV and hidden rows move to the rows of its
    positions (so the draft and the next step read them where a chain would have put
    them)."""

    def __init__(self, model, generator: torch.Generator, tree: DraftTree,
                 kv_caches: list[torch.Tensor | None], device: torch.device,
                 layer_groups: list[int] | None = None) -> None:
        self.model, self.generator, self.tree = model, generator, tree
        self.kv_caches, self.device = kv_caches, device
        self.layer_groups = layer_groups or [0] * len(kv_caches)  # layer -> KV cache group

    def lay_out(self, step: StepRows) -> None:
        """Node positions and the tree attention masks of the sequences with drafts."""
        batch = step.batch
        batch.tree_masks = self.tree.lay_out(batch.positions, batch.query_start_loc_cpu,
                                             step.drafts)

    def sample(self, hidden: torch.Tensor, step: StepRows) -> Sampled:
        logits = self.model.compute_logits(_rows(hidden, step.batch.sample_rows))
        out = verify_tree(logits, step.samplers, step.sampler_drafts, self.tree,
                          self.generator)
        self._keep_accepted_paths(step, hidden, out.paths)
        return _by_request(step.samplers, out.token_ids, out.logprobs)

    def _keep_accepted_paths(self, step: StepRows, hidden: torch.Tensor,
                             paths: list[list[int]]) -> None:
        """Move hidden rows and KV slots of each accepted path to its positions' rows.
        Gathers before it scatters, so overlapping moves are safe."""
        batch = step.batch
        src, dst = self.tree.path_moves(batch.query_start_loc_cpu, step.sampling, paths)
        if not src:
            return
        rows_src = torch.tensor(src, device=hidden.device)
        rows_dst = torch.tensor(dst, device=hidden.device)
        hidden[rows_dst] = hidden[rows_src]
        slots = batch.slot_mapping.to(self.device)  # (G, T)
        slot_src, slot_dst = slots[:, rows_src], slots[:, rows_dst]
        for cache, group in zip(self.kv_caches, self.layer_groups):
            if cache is not None:
                flat = cache.view(2, -1, *cache.shape[3:])  # (2, slots, KVH, D)
                flat[:, slot_dst[group]] = flat[:, slot_src[group]]


def _broadcast(group, token_ids: list[int] | None, n: int, device: torch.device) -> list[int]:
    """The group's first member's ``token_ids`` (n of them) on every member (a tensor on the
    model's device: NCCL moves CUDA tensors only)."""
    t = torch.tensor(token_ids or [0] * n, dtype=torch.int64, device=device)
    return group.broadcast(t).tolist()


def _by_request(samplers: list[SequenceState], token_ids: list[list[int]],
                logprobs: list) -> Sampled:
    return ({s.req_id: t for s, t in zip(samplers, token_ids)},
            {s.req_id: lp for s, lp in zip(samplers, logprobs) if lp is not None})


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; a slice (no index tensor to copy to the device) when rows are 0..n-1."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[rows]
