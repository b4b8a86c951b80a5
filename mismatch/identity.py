"""What a resume and a merge must match: the content of a run's inputs, not their names.

The rollouts file is hashed whole (SHA-256: ~1.8 GB/s on CPUs with SHA extensions, twice
BLAKE2b's speed here, 0.13 against 0.26 s for benchmarks/audit_stored.py's 233 MB file; the
command waits for it before its first block). A checkpoint's
weights are not (tens of GB): each weight file is known by its size, mtime and safetensors header
(tensor names, dtypes, shapes, offsets), config.json by its content. An engine is known by its
kind and fully parsed options (a TOML's content, not its path) and, for `python:`, the digest of
the module file that defines it. An HTTP server's own identity is not asked before the replay.
"""

from __future__ import annotations

import hashlib
import importlib.util
import struct
from pathlib import Path
from typing import Any

from mismatch.engines.spec import EngineSpec

_CHUNK = 1 << 20


def file_digest(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _safetensors_header_digest(path: Path) -> str:
    """Digest of a safetensors file's JSON header (8-byte length, then the header)."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return hashlib.blake2b(prefix).hexdigest()
        (length,) = struct.unpack("<Q", prefix)
        return hashlib.blake2b(prefix + handle.read(min(length, 100 * _CHUNK))).hexdigest()


def checkpoint_identity(checkpoint: str | Path) -> list[dict[str, Any]]:
    """Per weight file: name, size, mtime and header digest; config.json and tokenizer files whole."""
    root = Path(checkpoint)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        stat = path.stat()
        if path.suffix == ".safetensors":
            found.append({"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                          "header": _safetensors_header_digest(path)})
        elif path.suffix == ".json" and stat.st_size < 64 * _CHUNK:
            found.append({"file": path.name, "digest": file_digest(path)})
    return found


def engine_identity(spec: EngineSpec) -> dict[str, Any]:
    """Kind and parsed options; for a python: engine, the digest of its module's file too."""
    identity: dict[str, Any] = {"kind": spec.kind, "options": dict(spec.options)}
    if spec.kind == "python":
        identity["module"] = _module_digest(str(spec.options.get("target", "")))
    return identity


def _module_digest(target: str) -> str | None:
    module, _, _ = target.rpartition(":")
    if module.endswith(".py"):
        path: str | None = module
    else:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        path = found.origin if found is not None else None
    return file_digest(path) if path and Path(path).is_file() else None


def run_inputs(*, command: str, checkpoint: str | Path, rollouts: str | Path,
               engines: dict[str, EngineSpec], block_size: int, version: str) -> dict[str, Any]:
    """Everything a resumed or merged run must share with the run it continues (summary.json
    `inputs`; the work dir's manifest adds the shard)."""
    rollouts_path = Path(rollouts)
    return {"command": command, "mismatch_version": version, "block_size": block_size,
            "rollouts": {"size": rollouts_path.stat().st_size, "digest": file_digest(rollouts_path)}
            if rollouts_path.is_file() else None,
            "checkpoint": checkpoint_identity(checkpoint),
            "engines": {source: engine_identity(spec) for source, spec in engines.items()}}
