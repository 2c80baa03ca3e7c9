"""Iterate over the tensors of (possibly sharded) safetensors checkpoints, memory-mapped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from safetensors import safe_open

from heron.loader.lazy_tensor import LazyTensor, ReadCounter


def find_safetensors(path: Path) -> list[Path]:
    """The checkpoint files of an HF directory, honouring a sharded index if present."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: index names missing shard files {missing}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors weights (heron does not load pickled .bin checkpoints)")
    return files


def iter_safetensors(files: list[Path], counter: ReadCounter | None = None
                     ) -> Iterator[tuple[str, LazyTensor]]:
    """(name, tensor not read yet): each is read (all of it, or the slice a loader narrows
    it to) while the iteration is at it."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, LazyTensor(f.get_slice(name), counter)
