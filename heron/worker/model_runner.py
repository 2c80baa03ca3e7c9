"""Runs one step message: batch state update -> flat batch tensors + attention metadata ->
forward -> sampling (plain, or verifying drafts: ``sampling_strategies``) -> drafting for
the next step (``heron.speculative``) -> ``ModelRunnerOutput``."""

from __future__ import annotations

import logging

import numpy as np
import torch

from heron.attention import ForwardContext, forward_context, get_attention_backend
from heron.attention.context_parallel_ring import TokenSplit
from heron.attention.metadata import AttentionMetadata
from heron import envs
from heron.config import SpeculativeConfig
from heron.distributed import get_cp_group, get_pp_group, get_tp_group
from heron.distributed.pipeline import IntermediateTensors
from heron.layers.rotary import RotaryEmbedding
from heron.models.kv_cache_spec import kv_cache_groups
from heron.sample.logprobs import top_logprobs
from heron.sample.sampler import Sampler
from heron.speculative.factory import make_proposer
from heron.speculative.interface import DraftContext, StepView
from heron.worker.batch import HostBatch, to_device
from heron.worker.context_parallel_rows import gather_rows, localize, split_step
from heron.worker.cuda_graphs import DecodeGraphRunner
from heron.worker.input_batch import InputBatch, SequenceState
from heron.worker.sampling_strategies import (ChainVerification, PlainSampling, StepRows,
                                              TreeVerification)
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
    ``max_num_seqs`` (at most 256) requests. With ``speculative`` (and its loaded ``draft``,
    None for prompt lookup) a proposer drafts tokens after each step.

    Context parallelism (a CP group of N > 1 ranks): ``num_blocks`` counts the core's pool,
    of which this rank stores the ``num_blocks / N`` blocks whose id is ``rank`` mod N
    (``heron.attention.context_parallel``, whose backend replaces ``backend``). CP rank 0
    samples and broadcasts the tokens to the group; no CPU layer stack, no graphs.
    """

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, backend: str, seed: int, *, enforce_eager: bool = False,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 speculative: SpeculativeConfig | None = None, draft=None) -> None:
        arch = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self._tp, self._pp, self._cp = get_tp_group(), get_pp_group(), get_cp_group()
        cp = self._cp.world_size
        enforce_eager = enforce_eager or cp > 1  # CP: no CPU layer stack, no decode graphs
        self.backend = get_attention_backend(backend, device, self._cp)
        self.use_triton_ops = self.backend.name == "triton"
        # the CPU's captured-graph counterpart: decoder layers in one C++ call per step
        self.use_cpu_layer_stack = self.backend.name == "cpu" and not enforce_eager
        self.sampler = Sampler(seed, device)
        self.dtype = dtype
        self._is_driver = self._tp.is_first and self._cp.is_first and self._pp.is_last
        self.kv_groups = kv_cache_groups(arch)
        single = len(self.kv_groups) == 1
        if not single:
            self.use_cpu_layer_stack = False  # the stack reads one block table
        if draft is not None and draft.kv_layout() is not None and not self.kv_groups.has_full:
            logger.warning("the draft model's own KV cache follows this model's sliding-window "
                           "block table: it attends within the window only (outputs are "
                           "unchanged; fewer drafts may be accepted)")
        # layer -> its KV cache group (None: one group, every layer reads the step's metadata)
        self._layer_groups = None if single else self.kv_groups.group_of_layer(arch.num_layers)
        self.num_blocks = num_blocks // cp  # this rank's pool (all of it without CP)
        self.kv_caches = self._allocate_kv_caches(model)
        # No position reaches max_model_len (which the worker fit to the KV capacity: a model
        # with sliding layers only, or StreamingLLM, holds any length); rotary tables are
        # sized once for the context.
        self.max_context = max_model_len or min(num_blocks * block_size,
                                                arch.max_position_embeddings)
        self._rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        # length-dependent rope scaling (dynamic NTK, longrope): each token's sequence length
        # rides in the metadata (data-dependent cos/sin: no decode graphs)
        self._rope_lengths = any(m.needs_seq_lengths for m in self._rotary)
        self.graphs: DecodeGraphRunner | None = None
        self._reserve_rotary(self.max_context)
        self.input_batch = InputBatch(max_num_seqs, self.max_context, block_size,
                                      len(self.kv_groups))
        self._fault_token = envs.HERON_FAULT_INJECTION_TOKEN
        if device.type == "cuda" and self.backend.name == "triton" and not enforce_eager \
                and not self._rope_lengths and single:
            self.enable_decode_graphs(max_num_seqs)
        self.proposer = None if speculative is None else \
            make_proposer(speculative, draft, self._draft_context())
        # TP and CP ranks keep the sampled tokens themselves (no pipeline): the driver
        # broadcasts them; CP ranks other than 0 do not sample
        keeps = self._pp.world_size == 1
        self._plain = PlainSampling(model, self.sampler,
                                    self._tp if keeps and self._tp.world_size > 1 else None,
                                    self._cp if keeps and cp > 1 else None,
                                    samples=self._cp.is_first)
        self._verification = self._verification_strategy()

    def _allocate_kv_caches(self, model) -> list[torch.Tensor | None]:
        """Per layer of the model, the pool tensor it attends over: (2, num_blocks,
        block_size, num_kv_heads, head_dim) with this rank's KV heads; None for other stages'
        layers. Layers in the same slot of different KV cache groups share a tensor (a block
        id belongs to one group). Zeroed so padded, masked-out keys/values are finite
        (0 * NaN would poison the softmax sum)."""
        layers, kv_heads, head_dim = model.kv_cache_layout()
        num_layers = model.config.num_layers
        slot_of = self.kv_groups.slot_of_layer(num_layers)
        slots = {slot_of[i]: self.make_cache(kv_heads, head_dim)
                 for i in sorted({slot_of[i] for i in layers})}
        return [slots[slot_of[i]] if i in layers else None for i in range(num_layers)]

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
        with self._forward_context(md, self.kv_caches, self._layer_groups):
            return self.model(input_ids, positions, intermediate)

    def _forward_context(self, md: AttentionMetadata, kv_caches: list,
                         layer_groups: list[int] | None = None):
        """The ``with`` block in which model code attends over ``kv_caches`` through this
        runner's backend (a draft model's: the first KV cache group's tables)."""
        return forward_context(ForwardContext(md, kv_caches, self.backend, self.use_triton_ops,
                                              self.use_cpu_layer_stack, layer_groups))

    def _device_inputs(self, host: HostBatch):
        """(input_ids (T,), positions (T,), attention metadata) of ``host`` on the device."""
        tensors = to_device(host, self.device)
        md = host.metadata(tensors, self.block_size)
        return tensors["input_ids"], tensors["positions"], md

    def _draft_context(self) -> DraftContext:
        """What the proposer may use of this runner (``heron.speculative.interface``)."""
        return DraftContext(self.input_batch, self._device_inputs, self._draft_forward_context,
                            self.kv_caches, self.make_cache, self.device, self.max_context)

    def _draft_forward_context(self, md: AttentionMetadata, kv_caches: list):
        """A draft attends over its own cache with the first group's tables, or (a layer-skip
        draft) over this model's layers, each with its own group's."""
        groups = self._layer_groups if kv_caches is self.kv_caches else None
        return self._forward_context(md, kv_caches, groups)

    def _verification_strategy(self) -> ChainVerification | TreeVerification:
        """How steps with drafts verify them: as the tree the proposer drafts, or a chain."""
        tree = self.proposer.tree if self.proposer is not None else None
        if tree is None:
            return ChainVerification(self.model, self.sampler.generator)
        return TreeVerification(self.model, self.sampler.generator, tree, self.kv_caches,
                                self.device, self._layer_groups)

    def _reserve_rotary(self, length: int) -> None:
        """Rotary tables cover positions < length (host ints only, no device sync)."""
        rebuilt = [m.reserve(length, self.device) for m in self._rotary]
        if any(rebuilt) and self.graphs is not None:
            self.graphs.reset()  # they captured the old tables

    def _run_model(self, host: HostBatch, intermediate: IntermediateTensors | None = None,
                   split: TokenSplit | None = None):
        """The forward of the step's rows (``split``: this CP rank's share of them)."""
        self._reserve_rotary(max(host.seq_lens_cpu))
        if self.graphs is not None and self.graphs.can_run(host):
            return self.graphs.run(host)
        input_ids, positions, md = self._device_inputs(host)
        if split is not None:
            input_ids, positions = localize(split, md, input_ids, positions)
        return self._forward(md, input_ids, positions, intermediate)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's state changes, run it, and record what it sampled. Raises (with
        the batch state as before the forward) when the forward or sampling fails. Returns
        the outcome on the driver rank (TP rank 0 of the last stage), None on the others."""
        self.input_batch.update(sched)
        if sched.is_empty:
            return ModelRunnerOutput([], [], []) if self._is_driver else None
        strategy = self._verification if sched.spec_token_ids else self._plain
        step = self._step_rows(sched)
        strategy.lay_out(step)
        self._inject_fault(step.samplers)
        hidden = self._run_stage(step.batch)
        if not self._pp.is_last:  # hidden went to the next stage; tokens come by message
            self.input_batch.advance(sched.req_ids, sched.num_scheduled_tokens,
                                     [[] for _ in sched.req_ids])
            return None
        sampled, logprobs = strategy.sample(hidden, step) if step.samplers else ({}, {})
        prompt_lps = {step.states[i].req_id: self._prompt_logprobs(step.states[i], hidden, rows)
                      for i, rows in step.batch.prompt_lp_rows.items()}
        tokens = [sampled.get(r, []) for r in sched.req_ids]
        # with pipeline parallelism every stage learns the tokens from the core's next steps
        own = tokens if self._pp.world_size == 1 else [[] for _ in tokens]
        computed = [n - num_rejected(d, t) for n, d, t in
                    zip(sched.num_scheduled_tokens, step.drafts, tokens)]
        self.input_batch.advance(sched.req_ids, computed, own)
        spec = self._propose(step, hidden, sched.num_spec_tokens)
        if not self._is_driver:
            return None
        return ModelRunnerOutput(list(sched.req_ids), tokens,
                                 [logprobs.get(r) for r in sched.req_ids], prompt_lps, spec)

    def _step_rows(self, sched: SchedulerOutput) -> StepRows:
        """The step's flat batch (drafts staged after their sequences' tokens) and which
        sequences sample: those whose scheduled tokens reach their end."""
        self.input_batch.stage_drafts(sched.spec_token_ids)
        drafts = [sched.spec_token_ids.get(r, []) for r in sched.req_ids]
        batch = self.input_batch.host_batch(sched.req_ids, sched.num_scheduled_tokens,
                                            [len(d) for d in drafts])
        states = [self.input_batch.states[r] for r in sched.req_ids]
        if self._rope_lengths:  # L = max(position + 1, prompt length) per token
            prompts = torch.tensor([s.num_prompt_tokens for s in states])
            batch.rope_lengths = torch.maximum(batch.positions + 1, prompts.repeat_interleave(
                torch.tensor(batch.query_lens_cpu)))
        starts = [s.num_computed_tokens for s in states]
        sampling = [i for i, n in enumerate(sched.num_scheduled_tokens)
                    if starts[i] + n == states[i].num_tokens + len(drafts[i])]
        return StepRows(batch, states, starts, drafts, sampling, [states[i] for i in sampling])

    def _propose(self, step: StepRows, hidden: torch.Tensor, num_spec: int
                 ) -> dict[str, list[int]]:
        """Drafts for the next step. Drafting only ever speeds decoding up: if it fails, the
        sequences decode without drafts (the failure is logged) and nothing is lost."""
        proposer = self.proposer
        if proposer is None or not (num_spec or proposer.catches_up):
            return {}
        # with speculation off this step (num_spec 0) the proposer only keeps its KV current
        view = StepView(step.states, step.starts, step.sampling if num_spec else [],
                        step.batch.query_start_loc_cpu, hidden, num_spec)
        try:
            return proposer.propose(view)
        except Exception:  # noqa: BLE001
            logger.exception("drafting failed; these sequences decode without drafts")
            return {}

    def _run_stage(self, host: HostBatch) -> torch.Tensor:
        """This stage's forward: from the token ids (first stage) or the previous stage's
        output; a stage that is not the last sends its output on and returns it."""
        pp = self._pp
        intermediate = None
        split = split_step(host.query_lens_cpu, host.query_start_loc_cpu, host.seq_lens_cpu,
                           self._cp, self.block_size)
        rows = len(host.input_ids) if split is None else split.local_rows.numel()
        if not pp.is_first:
            shape = (rows, self.model.config.hidden_size)
            intermediate = IntermediateTensors(
                pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                        pp.rank_in_group - 1),
                pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                        pp.rank_in_group - 1))
        out = self._run_model(host, intermediate, split)
        if not pp.is_last:
            pp.send(out.hidden, pp.rank_in_group + 1)
            pp.send(out.residual, pp.rank_in_group + 1)
        elif split is not None:
            out = gather_rows(out, split, len(host.input_ids), self._cp)
        return out

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
        (on the driver; None on the other TP ranks, which compute their logit slices, and
        on CP ranks other than 0, which skip them)."""
        if not self._cp.is_first:
            return None
        logits = self.model.compute_logits(hidden[rows])
        if logits is None:
            return None
        logprobs = logits.log_softmax(-1).cpu()
        first = state.num_computed_tokens + 1  # position of the token the first row predicts
        targets = torch.tensor(state.prompt_token_ids[first:first + len(rows)])
        return [top_logprobs(logprobs[i], targets[i], state.params.prompt_logprobs)
                for i in range(len(rows))]

