"""Runs one step message: batch state update -> flat batch tensors + attention metadata ->
forward -> sampling (or verifying drafts) -> drafting for the next step ->
``ModelRunnerOutput``."""

from __future__ import annotations

import logging

import numpy as np
import torch

from heron.attention import ForwardContext, forward_context, get_attention_backend
from heron.attention.metadata import AttentionMetadata
from heron.config import fault_injection_token
from heron.distributed import get_pp_group, get_tp_group
from heron.distributed.pipeline import IntermediateTensors
from heron.layers.rotary import RotaryEmbedding
from heron.sample.logprobs import top_logprobs
from heron.sample.sampler import Sampler
from heron.worker.batch import HostBatch, to_device
from heron.worker.cuda_graphs import DecodeGraphRunner
from heron.worker.drafter import StepView
from heron.worker.input_batch import InputBatch, SequenceState
from heron.worker.rejection_sampler import verify
from heron.worker.tree_verify import verify_tree
from heron.worker.step import ModelRunnerOutput, SchedulerOutput, num_rejected

logger = logging.getLogger(__name__)


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
        self.dtype = dtype
        self._tp, self._pp = get_tp_group(), get_pp_group()
        self._is_driver = self._tp.is_first and self._pp.is_last
        # One tensor per layer of this stage: (2, num_blocks, block_size, num_kv_heads,
        # head_dim) with this rank's KV heads; None for other stages' layers. Zeroed so
        # padded, masked-out keys/values are finite (0 * NaN would poison the softmax sum).
        layers, kv_heads, head_dim = model.kv_cache_layout()
        self.num_blocks = num_blocks
        self.kv_caches = [self.make_cache(kv_heads, head_dim) if i in layers else None
                          for i in range(arch.num_layers)]
        # No position reaches the KV capacity; rotary tables are sized once for the context.
        self.max_context = min(num_blocks * block_size,
                               max_model_len or arch.max_position_embeddings)
        self._rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        self.graphs: DecodeGraphRunner | None = None
        self._reserve_rotary(self.max_context)
        self.input_batch = InputBatch(max_num_seqs, self.max_context, block_size)
        self._fault_token = fault_injection_token()
        self.proposer = None  # drafts tokens after each step (speculative decoding)
        self.tree = None  # drafts are the nodes of this DraftTree (else one chain)
        if device.type == "cuda" and self.backend.name == "triton" and not enforce_eager:
            self.enable_decode_graphs(max_num_seqs)

    def make_cache(self, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """One layer's zeroed KV cache over the pool: (2, num_blocks, block_size, KVH, D)."""
        shape = (2, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        return _zeros(shape, self.dtype, self.device)

    def enable_decode_graphs(self, max_batch: int, graph_factory=None) -> None:
        """From now on, decode steps of up to ``max_batch`` requests replay graphs, captured
        here (``graph_factory``: CUDA graphs by default; ``EagerGraph`` for CPU tests)."""
        self.graphs = DecodeGraphRunner(self._forward, max_batch,
                                        -(-self.max_context // self.block_size),
                                        self.block_size, self.device, graph_factory)
        self.graphs.capture_all()

    def _forward(self, md: AttentionMetadata, input_ids: torch.Tensor,
                 positions: torch.Tensor, intermediate: IntermediateTensors | None = None):
        """(T,) token ids and positions -> hidden states (T, hidden) (or, on a stage that is
        not the last, ``IntermediateTensors``), eagerly."""
        ctx = ForwardContext(md, self.kv_caches, self.backend, self.use_triton_ops)
        with forward_context(ctx):
            return self.model(input_ids, positions, intermediate)

    def _reserve_rotary(self, length: int) -> None:
        """Rotary tables cover positions < length (host ints only, no device sync)."""
        rebuilt = [m.reserve(length, self.device) for m in self._rotary]
        if any(rebuilt) and self.graphs is not None:
            self.graphs.reset()  # they captured the old tables

    def _run_model(self, host: HostBatch, intermediate: IntermediateTensors | None = None):
        self._reserve_rotary(max(host.seq_lens_cpu))
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host)
        tensors = to_device(host, self.device)
        md = host.metadata(tensors, self.block_size)
        return self._forward(md, tensors["input_ids"], tensors["positions"], intermediate)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's state changes, run it, and record what it sampled. Raises (with
        the batch state as before the forward) when the forward or sampling fails. Returns
        the outcome on the driver rank (TP rank 0 of the last stage), None on the others."""
        self.input_batch.update(sched)
        if sched.is_empty:
            return ModelRunnerOutput([], [], []) if self._is_driver else None
        self.input_batch.stage_drafts(sched.spec_token_ids)
        drafts = [sched.spec_token_ids.get(r, []) for r in sched.req_ids]
        batch = self.input_batch.host_batch(sched.req_ids, sched.num_scheduled_tokens,
                                            [len(d) for d in drafts])
        if self.tree is not None and sched.spec_token_ids:
            _lay_out_tree(batch, drafts, self.tree)
        states = [self.input_batch.states[r] for r in sched.req_ids]
        starts = [s.num_computed_tokens for s in states]
        sampling = [i for i, n in enumerate(sched.num_scheduled_tokens)
                    if starts[i] + n == states[i].num_tokens + len(drafts[i])]
        samplers = [states[i] for i in sampling]
        self._inject_fault(samplers)
        hidden = self._run_stage(batch)
        if not self._pp.is_last:  # hidden went to the next stage; tokens come by message
            self.input_batch.advance(sched.req_ids, sched.num_scheduled_tokens,
                                     [[] for _ in sched.req_ids])
            return None
        sampled, logprobs, paths = self._sample(hidden, batch, samplers,
                                                [drafts[i] for i in sampling])
        if paths:
            self._keep_accepted_paths(batch, hidden, sampling, paths)
        prompt_lps = {states[i].req_id: self._prompt_logprobs(states[i], hidden, rows)
                      for i, rows in batch.prompt_lp_rows.items()}
        tokens = [sampled.get(r, []) for r in sched.req_ids]
        # with pipeline parallelism every stage learns the tokens from the core's next steps
        own = tokens if self._pp.world_size == 1 else [[] for _ in tokens]
        computed = [n - num_rejected(d, t) for n, d, t in
                    zip(sched.num_scheduled_tokens, drafts, tokens)]
        self.input_batch.advance(sched.req_ids, computed, own)
        spec = self._propose(StepView(states, starts, sampling, batch, hidden,
                                      sched.num_spec_tokens))
        if not self._is_driver:
            return None
        return ModelRunnerOutput(list(sched.req_ids), tokens,
                                 [logprobs.get(r) for r in sched.req_ids], prompt_lps, spec)

    def _propose(self, view: StepView) -> dict[str, list[int]]:
        """Drafts for the next step. Drafting only ever speeds decoding up: if it fails, the
        sequences decode without drafts (the failure is logged) and nothing is lost."""
        if self.proposer is None or not (view.num_spec or self.proposer.catches_up):
            return {}
        if not view.num_spec:
            view.proposing = []  # speculation is off this step: only keep the KV current
        try:
            return self.proposer.propose(view)
        except Exception:  # noqa: BLE001
            logger.exception("drafting failed; these sequences decode without drafts")
            return {}

    def _run_stage(self, host: HostBatch) -> torch.Tensor:
        """This stage's forward: from the token ids (first stage) or the previous stage's
        output; a stage that is not the last sends its output on and returns it."""
        pp = self._pp
        intermediate = None
        if not pp.is_first:
            shape = (len(host.input_ids), self.model.config.hidden_size)
            intermediate = IntermediateTensors(
                pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                        pp.rank_in_group - 1),
                pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                        pp.rank_in_group - 1))
        out = self._run_model(host, intermediate)
        if not pp.is_last:
            pp.send(out.hidden, pp.rank_in_group + 1)
            pp.send(out.residual, pp.rank_in_group + 1)
        return out

    def _sample(self, hidden: torch.Tensor, batch: HostBatch, samplers: list[SequenceState],
                drafts: list[list[int]]):
        """Tokens (and logprobs) of the sampling sequences. Every TP rank computes its slice
        of the logits; the driver samples and, when the TP ranks keep tokens themselves
        (no pipeline), broadcasts the tokens to them. Sequences with drafts verify them:
        their tokens are the accepted drafts plus one (one rank only). Returns (tokens,
        logprobs) by request id, and the accepted tree paths by sampler index (trees only)."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        paths: dict[int, list[int]] = {}
        if not samplers:
            return sampled, logprobs, paths
        logits = self.model.compute_logits(_rows(hidden, batch.sample_rows))
        if any(drafts):
            if self.tree is not None:
                out = verify_tree(logits, samplers, drafts, self.tree, self.sampler.generator)
                paths = {j: p for j, p in enumerate(out.paths) if p}
            else:
                out = verify(logits, samplers, drafts, self.sampler.generator)
            for state, tokens, lps in zip(samplers, out.token_ids, out.logprobs):
                sampled[state.req_id] = tokens
                if lps is not None:
                    logprobs[state.req_id] = lps
            return sampled, logprobs, paths
        token_ids = None
        if logits is not None:
            out = self.sampler(logits, samplers)
            token_ids = out.token_ids
            for state, lp in zip(samplers, out.logprobs):
                if lp is not None:
                    logprobs[state.req_id] = [lp]
        if self._tp.world_size > 1 and self._pp.world_size == 1:
            t = torch.tensor(token_ids or [0] * len(samplers), dtype=torch.int64)
            token_ids = self._tp.broadcast(t).tolist()
        if token_ids is None:
            return sampled, logprobs, paths
        for state, token in zip(samplers, token_ids):
            sampled[state.req_id] = [token]
        return sampled, logprobs, paths

    def _keep_accepted_paths(self, batch: HostBatch, hidden: torch.Tensor,
                             sampling: list[int], paths: dict[int, list[int]]) -> None:
        """Move each accepted tree path to the slots (and hidden rows) of its positions: the
        node at depth d was computed in row ``root + 1 + node``, its position's slot (and
        the row a chain would have used) is ``root + d``. Gathers before it scatters, so
        overlapping moves are safe."""
        src, dst = [], []
        for j, path in paths.items():
            i = sampling[j]
            root = batch.query_start_loc_cpu[i + 1] - 1 - self.tree.num_nodes
            for depth, node in enumerate(path, start=1):
                if node + 1 != depth:
                    src.append(root + 1 + node)
                    dst.append(root + depth)
        if not src:
            return
        rows_src = torch.tensor(src, device=hidden.device)
        rows_dst = torch.tensor(dst, device=hidden.device)
        hidden[rows_dst] = hidden[rows_src]
        slots = batch.slot_mapping.to(self.device)
        slot_src, slot_dst = slots[rows_src], slots[rows_dst]
        for cache in self.kv_caches:
            if cache is not None:
                flat = cache.view(2, -1, *cache.shape[3:])  # (2, slots, KVH, D)
                flat[:, slot_dst] = flat[:, slot_src]

    def _inject_fault(self, samplers: list[SequenceState]) -> None:
        """HERON_FAULT_INJECTION_TOKEN: a sampling sequence whose prompt holds the token
        fails its step, as a bug would (reliability tests)."""
        if self._fault_token is None:
            return
        for state in samplers:
            if self._fault_token in state.prompt_token_ids:
                raise RuntimeError(f"injected fault (prompt holds token {self._fault_token})")

    def _prompt_logprobs(self, state: SequenceState, hidden, rows: list[int]):
        """Logprobs of prompt tokens start+1 .. start+len(rows), each given what precedes it
        (on the driver; None on the other TP ranks, which compute their logit slices)."""
        logits = self.model.compute_logits(hidden[rows])
        if logits is None:
            return None
        logprobs = logits.log_softmax(-1).cpu()
        first = state.num_computed_tokens + 1  # position of the token the first row predicts
        targets = torch.tensor(state.prompt_token_ids[first:first + len(rows)])
        return [top_logprobs(logprobs[i], targets[i], state.params.prompt_logprobs)
                for i in range(len(rows))]


def _lay_out_tree(batch: HostBatch, drafts: list[list[int]], tree) -> None:
    """Tree verification: a sequence's rows are its last token (the root) and one per node;
    node n moves to position root + depth(n) (its slot stays that of row root + 1 + n) and
    attends through the tree mask."""
    depths = torch.tensor(tree.depths())
    mask = tree.attention_mask()
    batch.tree_masks = {}
    for i, nodes in enumerate(drafts):
        if nodes:
            root = batch.query_start_loc_cpu[i + 1] - 1 - len(nodes)
            batch.positions[root + 1:root + 1 + len(nodes)] = batch.positions[root] + depths
            batch.tree_masks[i] = mask


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; a slice (no index tensor to copy to the device) when rows are 0..n-1."""
    if rows == list(range(len(rows))):
        return hidden[:len(rows)]
    return hidden[rows]
