"""Runs one step message: batch state update -> flat batch tensors + attention metadata ->
forward -> sampling -> ``ModelRunnerOutput``."""

from __future__ import annotations

import numpy as np
import torch

from heron.attention import ForwardContext, forward_context, get_attention_backend
from heron.attention.metadata import AttentionMetadata
from heron.config import fault_injection_token
from heron.layers.rotary import RotaryEmbedding
from heron.worker.batch import HostBatch, to_device
from heron.worker.cuda_graphs import DecodeGraphRunner
from heron.worker.input_batch import InputBatch, SequenceState
from heron.worker.sampler import Sampler, top_logprobs
from heron.worker.step import ModelRunnerOutput, SchedulerOutput


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by calloc'd pages, so an unused pool costs no time or RSS."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elems = 1
    for dim in shape:
        elems *= dim
    raw = np.zeros(elems * (torch.finfo(dtype).bits // 8), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


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
        self.input_batch = InputBatch(max_num_seqs, self.max_context, block_size)
        self._fault_token = fault_injection_token()
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
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's state changes, run it, and record what it sampled. Raises (with
        the batch state as before the forward) when the forward or sampling fails."""
        self.input_batch.update(sched)
        if sched.is_empty:
            return ModelRunnerOutput([], [], [])
        batch = self.input_batch.host_batch(sched.req_ids, sched.num_scheduled_tokens)
        states = [self.input_batch.states[r] for r in sched.req_ids]
        samplers = [states[i] for i, n in enumerate(sched.num_scheduled_tokens)
                    if states[i].num_computed_tokens + n == states[i].num_tokens]
        self._inject_fault(samplers)
        hidden = self._run_model(batch)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        if samplers:
            logits = self.model.compute_logits(_rows(hidden, batch.sample_rows))
            out = self.sampler(logits, samplers)
            for state, token, lp in zip(samplers, out.token_ids, out.logprobs):
                sampled[state.req_id] = [token]
                if lp is not None:
                    logprobs[state.req_id] = [lp]
        prompt_lps = {states[i].req_id: self._prompt_logprobs(states[i], hidden, rows)
                      for i, rows in batch.prompt_lp_rows.items()}
        tokens = [sampled.get(r, []) for r in sched.req_ids]
        self.input_batch.advance(sched.req_ids, sched.num_scheduled_tokens, tokens)
        return ModelRunnerOutput(list(sched.req_ids), tokens,
                                 [logprobs.get(r) for r in sched.req_ids], prompt_lps)

    def _inject_fault(self, samplers: list[SequenceState]) -> None:
        """HERON_FAULT_INJECTION_TOKEN: a sampling sequence whose prompt holds the token
        fails its step, as a bug would (reliability tests)."""
        if self._fault_token is None:
            return
        for state in samplers:
            if self._fault_token in state.prompt_token_ids:
                raise RuntimeError(f"injected fault (prompt holds token {self._fault_token})")

    def _prompt_logprobs(self, state: SequenceState, hidden, rows: list[int]):
        """Logprobs of prompt tokens start+1 .. start+len(rows), each given what precedes it."""
        logprobs = self.model.compute_logits(hidden[rows]).log_softmax(-1).cpu()
        first = state.num_computed_tokens + 1  # position of the token the first row predicts
        targets = torch.tensor(state.prompt_token_ids[first:first + len(rows)])
        return [top_logprobs(logprobs[i], targets[i], state.params.prompt_logprobs)
                for i in range(len(rows))]


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; a slice (no index tensor to copy to the device) when rows are 0..n-1."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[rows]
