"""What a resume and a merge must match: the content of a run's inputs, never their names or times.

The rollouts file is hashed whole (SHA-256: ~1.8 GB/s on CPUs with SHA extensions, twice
BLAKE2b's speed here, 0.13 against 0.26 s for benchmarks/audit_stored.py's 233 MB file; the
command waits for it before its first block). A checkpoint's weight files are hashed whole too,
once: their digests are cached by file (path, size, mtime, ctime, inode) in the user's cache dir
(`digest_cache_dir`), so an unchanged checkpoint costs a stat per file (benchmarks/identity_hash.py).
What is recorded is each file's name, size and digest, so a copy of a checkpoint on another node is
the same checkpoint and a file edited in place is not. Its config and tokenizer files are hashed
whole. An engine is known by its kind and fully parsed options (a TOML's content, not its path;
a `checkpoint=` dir by its files) and, for `python:`, the digest of the module file that defines
it. An HTTP server's own identity is not asked before the replay.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from mismatch.engines.spec import EngineSpec
from mismatch.results.staging import RACY_NS  # noqa: F401 - how fresh a stamp is too fresh to cache (stamp_vouches)
from mismatch.results.staging import atomic_write_text, file_sha256, stamp_vouches

file_digest = file_sha256  # a run's inputs are digested as its published files are

_CHUNK = 1 << 20
_SMALL_SUFFIXES = frozenset({".json", ".jinja", ".model", ".txt", ".tiktoken"})  # config, tokenizer
CACHE_FILE = "digests.json"
_CACHE_VERSION = 1
_CACHE_ENTRIES = 4096  # the most recently used files kept (~200 bytes each)


def content_digest(path: str | Path) -> str:
    """A weight file's SHA-256 (its own name: the digest cache's tests count the weight files hashed)."""
    return file_digest(path)


def digest_cache_dir() -> Path:
    """$MISMATCH_CACHE_DIR, else $XDG_CACHE_HOME/mismatch, else ~/.cache/mismatch."""
    if os.environ.get("MISMATCH_CACHE_DIR"):
        return Path(os.environ["MISMATCH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mismatch"


class Stamp(msgspec.Struct, frozen=True, kw_only=True):
    """What must not have moved for a cached digest to stand. ctime is in it because nothing but a
    change sets it: `os.utime` puts an mtime back after an edit, never a ctime."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int


def _stamp(stat: os.stat_result) -> Stamp:
    return Stamp(size=stat.st_size, mtime_ns=stat.st_mtime_ns, ctime_ns=stat.st_ctime_ns, ino=stat.st_ino,
                 dev=stat.st_dev)


class CachedDigest(Stamp, frozen=True, kw_only=True):
    sha256: str
    used_ns: int = 0  # when last used: the oldest are dropped past _CACHE_ENTRIES

    @property
    def stamp(self) -> Stamp:
        return Stamp(size=self.size, mtime_ns=self.mtime_ns, ctime_ns=self.ctime_ns, ino=self.ino, dev=self.dev)


class CacheFile(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    files: dict[str, CachedDigest]  # by resolved path


class DigestCache:
    """Weight-file digests by path and stamp, in one small JSON file rewritten atomically. It is a
    speed-up only: a missing, corrupt or unwritable cache means hashing again, never an error."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.entries = self._load(file)
        self.changed = False

    @staticmethod
    def _load(file: Path) -> dict[str, CachedDigest]:
        try:
            cached = msgspec.json.decode(file.read_bytes(), type=CacheFile)
        except (OSError, msgspec.DecodeError):  # ValidationError is a DecodeError: another shape, no cache
            return {}
        return cached.files if cached.version == _CACHE_VERSION else {}

    def digest(self, path: Path) -> str:
        key = str(path.resolve())
        stat = path.stat()
        entry = self.entries.get(key)  # a map by path
        if entry is not None and entry.stamp == _stamp(stat):
            self.entries[key] = msgspec.structs.replace(entry, used_ns=time.time_ns())
            self.changed = True
            return entry.sha256
        started = time.time_ns()
        digest = content_digest(path)
        after = path.stat()
        # Changed while hashed, or too recently to trust its stamp: the digest stands, uncached.
        if _stamp(after) == _stamp(stat) and stamp_vouches(stat.st_mtime_ns, stat.st_ctime_ns, started):
            self.entries[key] = CachedDigest(**msgspec.structs.asdict(_stamp(stat)), sha256=digest, used_ns=started)
            self.changed = True
        return digest

    def save(self) -> None:
        if not self.changed:
            return
        newest = sorted(self.entries.items(), key=lambda item: item[1].used_ns, reverse=True)
        try:
            atomic_write_text(self.file, msgspec.json.encode(
                CacheFile(version=_CACHE_VERSION, files=dict(newest[:_CACHE_ENTRIES]))).decode() + "\n")
        except OSError:
            return  # a read-only or full home: the next run hashes again
        self.changed = False


def checkpoint_identity(checkpoint: str | Path, cache: DigestCache | None = None) -> list[dict[str, Any]]:
    """Per weight file (safetensors): name, size and SHA-256 (cached); config and tokenizer files:
    name and digest. Never a time or an inode: a copy is the same checkpoint."""
    root = Path(checkpoint)
    if not root.is_dir():
        return []
    own = cache is None
    cache = cache or DigestCache(digest_cache_dir() / CACHE_FILE)
    found = []
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        size = path.stat().st_size
        if path.suffix == ".safetensors":
            found.append({"file": path.name, "size": size, "sha256": cache.digest(path)})
        elif path.suffix in _SMALL_SUFFIXES and size < 64 * _CHUNK:
            found.append({"file": path.name, "digest": file_digest(path)})
    if own:
        cache.save()
    return found


def engine_identity(spec: EngineSpec, cache: DigestCache | None = None) -> dict[str, Any]:
    """Kind and parsed options, a `checkpoint=` dir by its files; for a python: engine, the digest
    of its module's file too."""
    options = dict(spec.options)
    if isinstance(options.get("checkpoint"), str) and Path(options["checkpoint"]).is_dir():
        options["checkpoint"] = {"files": checkpoint_identity(options["checkpoint"], cache)}
    identity: dict[str, Any] = {"kind": spec.kind, "options": options}
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
               engines: dict[str, EngineSpec], block_size: int, version: str,
               options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a resumed or merged run must share with the run it continues (summary.json
    `inputs`; the work dir's manifest adds the shard). `options`: the command's options that
    change its numbers but not its replay (a merge must match them; a resume re-analyses)."""
    rollouts_path = Path(rollouts)
    cache = DigestCache(digest_cache_dir() / CACHE_FILE)
    inputs = {"command": command, "mismatch_version": version, "block_size": block_size,
              "rollouts": {"size": rollouts_path.stat().st_size, "digest": file_digest(rollouts_path)}
              if rollouts_path.is_file() else None,
              "checkpoint": checkpoint_identity(checkpoint, cache),
              "engines": {source: engine_identity(spec, cache) for source, spec in engines.items()}}
    cache.save()
    if options is not None:
        inputs["options"] = options
    return inputs
