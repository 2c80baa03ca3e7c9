"""Runs one scheduled step: flat batch tensors + attention metadata -> forward -> sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from heron.attention import AttentionMetadata, ForwardContext, forward_context, get_attention_backend
from heron.engine.scheduler import ScheduledRequest, SchedulerOutput
from heron.outputs import PositionLogprobs
from heron.runner.sampler import Sampler, top_logprobs


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by calloc'd pages, so an unused pool costs no time or RSS."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elems = 1
    for dim in shape:
        elems *= dim
    raw = np.zeros(elems * (torch.finfo(dtype).bits // 8), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass
class StepResult:
    """Per scheduled request: the sampled token (or None mid-prefill) and any logprobs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


@dataclass
class _Batch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    sample_rows: list[int]  # flat token index of the last token of each sampling request
    prompt_lp_rows: dict[int, list[int]]  # scheduled index -> token rows needing prompt logprobs


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, backend: str, seed: int) -> None:
        arch = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = get_attention_backend(backend)
        self.sampler = Sampler(seed)
        # One tensor per layer: (2, num_blocks, block_size, num_kv_heads, head_dim). Zeroed so
        # padded, masked-out keys/values are finite (0 * NaN would poison the softmax sum).
        shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [_zeros(shape, dtype, device) for _ in range(arch.num_layers)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        batch = self._prepare(sched.scheduled)
        ctx = ForwardContext(batch.metadata, self.kv_caches, self.backend)
        with forward_context(ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        result = StepResult()
        samplers = [s.request for s in sched.scheduled if s.samples]
        if samplers:
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            out = self.sampler(logits, samplers)
            for req, token, lp in zip(samplers, out.token_ids, out.logprobs):
                result.sampled[req.request_id] = token
                if lp is not None:
                    result.logprobs[req.request_id] = lp
        for idx, rows in batch.prompt_lp_rows.items():
            s = sched.scheduled[idx]
            result.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(s, hidden, rows)
        return result

    def _prompt_logprobs(self, s: ScheduledRequest, hidden, rows: list[int]):
        """Logprobs of prompt tokens start+1 .. start+len(rows), each given what precedes it."""
        req = s.request
        logprobs = self.model.compute_logits(hidden[rows]).log_softmax(-1).cpu()
        first = req.num_computed_tokens + 1  # position of the token the first row predicts
        targets = torch.tensor(req.prompt_token_ids[first:first + len(rows)])
        return [top_logprobs(logprobs[i], targets[i], req.params.prompt_logprobs)
                for i in range(len(rows))]

    def _prepare(self, scheduled: list[ScheduledRequest]) -> _Batch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, starts = [], [], [0]
        sample_rows: list[int] = []
        prompt_lp_rows: dict[int, list[int]] = {}
        for idx, s in enumerate(scheduled):
            req, start, n = s.request, s.request.num_computed_tokens, s.num_tokens
            tokens = req.token_ids_between(start, start + n)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            starts.append(starts[-1] + n)
            if s.samples:
                sample_rows.append(starts[-1] - 1)
            if req.wants_prompt_logprobs:
                # rows at positions p < num_prompt - 1 predict prompt token p + 1
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > start:
                    prompt_lp_rows[idx] = list(range(starts[-2], starts[-2] + last - start))
        max_blocks = max(len(s.request.block_ids) for s in scheduled)
        tables = [s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids))
                  for s in scheduled]
        dev = self.device
        block_tables = torch.tensor(tables, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        req_of_token = torch.repeat_interleave(torch.arange(len(scheduled)),
                                               torch.tensor(query_lens))
        slots = (block_tables[req_of_token, pos // self.block_size] * self.block_size
                 + pos % self.block_size)
        md = AttentionMetadata(
            slot_mapping=slots.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=dev),
            query_start_loc_cpu=starts,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        return _Batch(torch.tensor(input_ids, dtype=torch.long, device=dev), pos.to(dev), md,
                      sample_rows, prompt_lp_rows)
