"""Runs one scheduled step: flat batch tensors + attention metadata -> forward -> sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from heron.attention import ForwardContext, forward_context, get_attention_backend
from heron.attention.metadata import AttentionMetadata
from heron.engine.scheduler import ScheduledRequest, SchedulerOutput
from heron.layers.rotary import RotaryEmbedding
from heron.outputs import PositionLogprobs
from heron.worker.batch import HostBatch, build_host_batch, to_device
from heron.worker.cuda_graphs import DecodeGraphRunner
from heron.worker.sampler import Sampler, top_logprobs


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


class ModelRunner:
    """Runs scheduled steps on one model: batch tensors, forward (eager, or a replayed CUDA
    graph for decode steps), logits and sampling.

    ``backend`` names the attention backend ("auto", "torch", "triton"); the triton backend
    also switches on the fused Triton norm / rotary / activation kernels. CUDA graphs are used
    with the triton backend on CUDA unless ``enforce_eager``, for decode batches of up to
    ``max_num_seqs`` (at most 256) requests.
    """

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, backend: str, seed: int, *, enforce_eager: bool = False,
                 max_num_seqs: int = 256, max_model_len: int | None = None) -> None:
        arch = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = get_attention_backend(backend, device)
        self.use_triton_ops = self.backend.name == "triton"
        self.sampler = Sampler(seed, device)
        # One tensor per layer: (2, num_blocks, block_size, num_kv_heads, head_dim). Zeroed so
        # padded, masked-out keys/values are finite (0 * NaN would poison the softmax sum).
        shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [_zeros(shape, dtype, device) for _ in range(arch.num_layers)]
        # No position reaches the KV capacity; rotary tables are sized once for the context.
        self.max_context = min(num_blocks * block_size,
                               max_model_len or arch.max_position_embeddings)
        self._rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        self.graphs: DecodeGraphRunner | None = None
        self._reserve_rotary(self.max_context)
        if device.type == "cuda" and self.backend.name == "triton" and not enforce_eager:
            self.enable_decode_graphs(max_num_seqs)

    def enable_decode_graphs(self, max_batch: int, graph_factory=None) -> None:
        """From now on, decode steps of up to ``max_batch`` requests replay graphs, captured
        here (``graph_factory``: CUDA graphs by default; ``EagerGraph`` for CPU tests)."""
        self.graphs = DecodeGraphRunner(self._forward, max_batch,
                                        -(-self.max_context // self.block_size),
                                        self.block_size, self.device, graph_factory)
        self.graphs.capture_all()

    def _forward(self, md: AttentionMetadata, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and positions -> hidden states (T, hidden), eagerly."""
        ctx = ForwardContext(md, self.kv_caches, self.backend, self.use_triton_ops)
        with forward_context(ctx):
            return self.model(input_ids, positions)

    def _reserve_rotary(self, length: int) -> None:
        """Rotary tables cover positions < length (host ints only, no device sync)."""
        rebuilt = [m.reserve(length, self.device) for m in self._rotary]
        if any(rebuilt) and self.graphs is not None:
            self.graphs.reset()  # they captured the old tables

    def _run_model(self, host: HostBatch) -> torch.Tensor:
        self._reserve_rotary(max(host.seq_lens_cpu))
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host)
        tensors = to_device(host, self.device)
        md = host.metadata(tensors, self.block_size)
        return self._forward(md, tensors["input_ids"], tensors["positions"])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        batch = build_host_batch(sched.scheduled, self.block_size)
        hidden = self._run_model(batch)
        result = StepResult()
        samplers = [s.request for s in sched.scheduled if s.samples]
        if samplers:
            logits = self.model.compute_logits(_rows(hidden, batch.sample_rows))
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


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; a slice (no index tensor to copy to the device) when rows are 0..n-1."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[rows]
