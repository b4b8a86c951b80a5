"""The weight-digest cache file (mismatch/identity.py): decoded once into typed records, a speed-up only,
so a file of another shape or version is no cache (hashed again), never an error."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mismatch import identity


def _weights(tmp_path: Path) -> Path:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 1024)
    time.sleep(identity.RACY_NS / 1e9 + 0.05)  # a file changed just before it is hashed is not cached
    return weights


def test_a_digest_is_cached_with_its_stamp_and_read_back_typed(tmp_path: Path, monkeypatch) -> None:
    weights, cache_file = _weights(tmp_path), tmp_path / "cache" / identity.CACHE_FILE
    cache = identity.DigestCache(cache_file)
    digest = cache.digest(weights)
    cache.save()
    written = json.loads(cache_file.read_text())
    entry = written["files"][str(weights.resolve())]
    assert written["version"] == 1 and entry["sha256"] == digest == identity.file_digest(weights)
    assert set(entry) == {"size", "mtime_ns", "ctime_ns", "ino", "dev", "sha256", "used_ns"}
    again = identity.DigestCache(cache_file)
    assert again.entries[str(weights.resolve())].sha256 == digest
    hashed: list[Path] = []
    real = identity.content_digest
    monkeypatch.setattr(identity, "content_digest", lambda path: hashed.append(path) or real(path))
    assert again.digest(weights) == digest and hashed == []  # the stamp stands: not hashed again


def test_a_cache_file_of_another_shape_or_version_is_no_cache(tmp_path: Path) -> None:
    cache_file = tmp_path / identity.CACHE_FILE
    good = {"size": 1, "mtime_ns": 1, "ctime_ns": 1, "ino": 1, "dev": 1, "sha256": "0" * 64, "used_ns": 1}
    for content in ("{ not json", "[]", json.dumps({"version": 1, "files": {"/w": {**good, "size": "1"}}}),
                    json.dumps({"version": 2, "files": {"/w": good}}), json.dumps({"version": 1})):
        cache_file.write_text(content)
        assert identity.DigestCache(cache_file).entries == {}, content
    cache_file.write_text(json.dumps({"version": 1, "files": {"/w": good}}))
    assert identity.DigestCache(cache_file).entries["/w"].sha256 == "0" * 64
