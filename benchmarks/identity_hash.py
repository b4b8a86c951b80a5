"""What identity by content costs: a checkpoint's weight files hashed whole, then found in the cache.

Usage: python benchmarks/identity_hash.py [--gib 3] [--dir /tmp/mismatch-identity-bench] [--repeat 3]

Writes a checkpoint of one safetensors file of --gib GiB (random bytes, every block written: not
sparse) and a config.json, then times `mismatch.identity.checkpoint_identity` on it, with its own
digest cache (MISMATCH_CACHE_DIR in --dir):
- the first hash from the page cache (the file was just written; what a run right after a trainer
  saved its checkpoint pays) and from the disk (the file's pages dropped with posix_fadvise first),
  each --repeat times with the cache cleared, best of each;
- the cached lookup (a second run of the same checkpoint: a stat per file and the cache's JSON);
- SHA-256 and BLAKE2b over 256 MiB in memory (which hash the identity uses).
Deletes the checkpoint at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import time
from pathlib import Path

GIB = 1 << 30
_PIECE = 64 << 20


def write_checkpoint(root: Path, size: int) -> Path:
    """config.json and model.safetensors (one uint8 tensor of `size` bytes), fsynced."""
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    rng = np.random.default_rng(0)
    with open(root / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        for start in range(0, size, _PIECE):
            handle.write(rng.integers(0, 256, min(_PIECE, size - start), dtype=np.uint8).tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    return root


def drop_pages(file: Path) -> None:
    with open(file, "rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed_identity(root: Path) -> float:
    from mismatch.identity import checkpoint_identity

    start = time.perf_counter()
    checkpoint_identity(root)
    return time.perf_counter() - start


def hash_speeds() -> dict[str, float]:
    data = os.urandom(256 << 20)
    speeds = {}
    for name in ("sha256", "blake2b"):
        start = time.perf_counter()
        hashlib.new(name, data).hexdigest()
        speeds[name] = round(len(data) / GIB / (time.perf_counter() - start), 2)
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-identity-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from mismatch.identity import CACHE_FILE, RACY_NS

    cache = args.dir / "cache"
    os.environ["MISMATCH_CACHE_DIR"] = str(cache)
    size = int(args.gib * GIB)
    try:
        start = time.perf_counter()
        root = write_checkpoint(args.dir / "ckpt", size)
        written = time.perf_counter() - start
        time.sleep(RACY_NS / 1e9 + 0.1)  # older than the racy window: its digest is cached
        warm, cold = [], []
        for _ in range(args.repeat):
            (cache / CACHE_FILE).unlink(missing_ok=True)
            warm.append(timed_identity(root))
            (cache / CACHE_FILE).unlink(missing_ok=True)
            drop_pages(root / "model.safetensors")
            cold.append(timed_identity(root))
        cached = min(timed_identity(root) for _ in range(max(args.repeat, 5)))
        print(json.dumps({
            "file_gib": round(size / GIB, 2), "write_s": round(written, 2),
            "first_hash_page_cache_s": round(min(warm), 3), "first_hash_disk_s": round(min(cold), 3),
            "first_hash_gib_per_s": round(size / GIB / min(warm), 2),
            "cached_lookup_ms": round(cached * 1e3, 3), "every_run_s": {"page_cache": [round(t, 3) for t in warm],
                                                                       "disk": [round(t, 3) for t in cold]},
            "hash_gib_per_s_in_memory": hash_speeds()}, indent=1))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
