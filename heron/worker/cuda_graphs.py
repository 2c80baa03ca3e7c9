"""CUDA graphs for decode steps: one graph per bucketed batch size, captured once, replayed.

A decode-only step of ``n`` requests runs the graph of the smallest bucket ``b >= n``. Each
graph was captured over static input buffers (rows ``[:b]``). A step writes its inputs into
rows ``[:n]`` and pads rows ``[n:b]``: slot -1 (the KV store skips it), seq_len 0 (decode
attention gives zeros), token and position 0; output rows ``[n:]`` are ignored. Captures
run on padding only, so they never write the KV cache. Prefill or mixed steps, batches above
the largest bucket and contexts wider than the static block table run eagerly.

The capture/replay mechanism is injectable (``graph_factory``): ``EagerGraph`` replays by
re-running the captured function, which lets the bucketing and padding be tested on a CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from heron.attention import AttentionMetadata
from heron.worker.batch import HostBatch

# forward(metadata, input_ids, positions) -> hidden states (num_tokens, hidden)
ForwardFn = Callable[[AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor]

MAX_GRAPH_BATCH = 256
_INPUT_IDS, _POSITIONS, _SLOTS, _SEQ_LENS = range(4)
_PAD = (0, 0, -1, 0)  # padding value of each row of StaticDecodeInputs.scalars


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first of them that holds ``max_batch``."""
    candidates = [1, 2, 4] + list(range(8, max_batch + 8, 8))
    return [b for b in candidates if b < max_batch] + [bucket_for(max_batch, candidates)]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class StaticDecodeInputs:
    """The device buffers every decode graph reads; a graph of bucket ``b`` uses rows [:b]."""

    scalars: torch.Tensor  # (4, max_batch) int64: input ids, positions, slots, seq lens
    block_tables: torch.Tensor  # (max_batch, max_blocks) int64
    query_start_loc: torch.Tensor  # (max_batch + 1,) = arange: one query per request
    block_size: int

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device) -> "StaticDecodeInputs":
        scalars = torch.tensor(_PAD, dtype=torch.long).view(4, 1).repeat(1, max_batch)
        return cls(scalars.to(device), torch.zeros(max_batch, max_blocks, dtype=torch.long,
                                                   device=device),
                   torch.arange(max_batch + 1, device=device), block_size)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Views of the first ``bucket`` rows. Only device tensors and the number of requests
        are valid under replay; ``seq_lens_cpu`` is a placeholder that graph-safe backends
        (the triton decode path) never read."""
        return AttentionMetadata(
            slot_mapping=self.scalars[_SLOTS, :bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.scalars[_SEQ_LENS, :bucket],
            query_start_loc=self.query_start_loc[:bucket + 1],
            query_start_loc_cpu=list(range(bucket + 1)), query_lens_cpu=[1] * bucket,
            seq_lens_cpu=[0] * bucket, block_size=self.block_size)

    def pad(self, bucket: int) -> None:
        """Rows [:bucket] become padding."""
        self.scalars[:, :bucket].copy_(torch.tensor(_PAD).view(4, 1).expand(4, bucket))

    def stage(self, host: HostBatch, bucket: int) -> None:
        """Rows [:n] get the step's inputs, rows [n:bucket] padding."""
        n, width = host.num_reqs, host.block_tables.shape[2]  # one KV cache group
        rows = torch.tensor(_PAD).view(4, 1).repeat(1, bucket)  # (4, bucket) on the host
        rows[_INPUT_IDS, :n] = host.input_ids
        rows[_POSITIONS, :n] = host.positions
        rows[_SLOTS, :n] = host.slot_mapping[0]
        rows[_SEQ_LENS, :n] = host.seq_lens
        _copy_from_host(self.scalars[:, :bucket], rows)
        # columns >= width of rows [:n] keep stale ids: never read, as seq_len <= width * bs
        _copy_from_host(self.block_tables[:n, :width], host.block_tables[0])


def _copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """An asynchronous host-to-device copy (no wait for the device); torch's pinned-memory
    allocator keeps the pinned source alive until the copy has run."""
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


class CudaGraph:
    """torch.cuda.CUDAGraph, warmed up once before capture; graphs share one memory pool."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        fn()  # warm-up outside the graph: compiles Triton kernels, sets up cuBLAS workspaces
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A CUDA graph's contract without CUDA: replay re-runs the captured function on the same
    static buffers and writes the same output tensor (for CPU tests)."""

    def __init__(self, pool=None) -> None:
        self.fn = self.out = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class DecodeGraphRunner:
    """Captures and replays decode graphs for one model and KV cache."""

    def __init__(self, forward: ForwardFn, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device, graph_factory=None) -> None:
        self.forward = forward
        self.buckets = decode_buckets(min(max_batch, MAX_GRAPH_BATCH))
        self.max_blocks = max_blocks
        self.inputs = StaticDecodeInputs.allocate(self.buckets[-1], max_blocks, block_size,
                                                  device)
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CudaGraph(pool)  # noqa: E731
        self.graph_factory = graph_factory
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph, output)

    def can_run(self, host: HostBatch) -> bool:
        return (host.is_decode_only and host.num_reqs <= self.buckets[-1]
                and host.block_tables.shape[2] <= self.max_blocks and host.streaming is None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Largest bucket first, so smaller graphs reuse its pool memory."""
        for bucket in reversed(self.buckets):
            self._capture(bucket)

    def reset(self) -> None:
        """Drop every graph (e.g. after tensors they captured were replaced)."""
        self.graphs.clear()

    def run(self, host: HostBatch) -> torch.Tensor:
        """Hidden states (n, hidden) of a decode step with ``can_run(host)``."""
        bucket = bucket_for(host.num_reqs, self.buckets)
        if bucket not in self.graphs:
            self._capture(bucket)
        graph, out = self.graphs[bucket]
        self.inputs.stage(host, bucket)
        graph.replay()
        return out[:host.num_reqs]

    def _capture(self, bucket: int) -> None:
        self.inputs.pad(bucket)  # capture (and its warm-up) must not touch the KV cache
        md = self.inputs.metadata(bucket)
        ids = self.inputs.scalars[_INPUT_IDS, :bucket]
        pos = self.inputs.scalars[_POSITIONS, :bucket]
        graph = self.graph_factory()
        out = graph.capture(lambda: self.forward(md, ids, pos))
        self.graphs[bucket] = (graph, out)
