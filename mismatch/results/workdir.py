"""The work dir of an audit in progress: its finished blocks' log-prob columns (and routing,
engine facts, finished stages) beside the results dir, so a rerun after a kill resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mismatch.errors import ResultsError
from mismatch.results.jsonio import json_safe
from mismatch.results.staging import atomic_write_text


class WorkDir:
    """Finished (source, block) log-prob columns of an audit in progress, for resuming after a kill.

    Lives beside the results dir as `.NAME.work/`; its manifest names the inputs, so a rerun of the
    same command resumes and a different command never picks up another run's blocks.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], *, force: bool = False) -> None:
        self.path = path
        self.manifest = manifest
        self.force = force  # the run's --force: a damaged block is replayed, not refused (replay/replayed.py)
        self._facts: dict[str, dict[str, Any]] = {}  # source -> engine_facts, written with its first block

    @classmethod
    def open(cls, out: Path, manifest: dict[str, Any], *, force: bool) -> WorkDir:
        path = out.parent / f".{out.name}.work"
        manifest_file = path / "manifest.json"
        if path.exists():
            previous = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
            if previous != json_safe(manifest):
                if not force:
                    raise ResultsError(f"{path}: holds an interrupted run with other inputs; "
                                       "pass --force to discard it")
                shutil.rmtree(path)
        # Nothing is created until the first block is saved: bad input must leave nothing behind.
        return cls(path, manifest, force=force)

    def block_file(self, source: str, block: int) -> Path:
        """Where a (source, block) log-prob column is saved (errors name it)."""
        return self.path / f"{source}-{block:06d}.npy"

    def load(self, source: str, block: int) -> np.ndarray | None:
        file = self.block_file(source, block)
        if not file.is_file():
            return None
        try:
            return np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError):
            # Saves are atomic, so only something outside this tool makes a block unreadable
            # (an empty or cut file): replayed again, never trusted and never fatal.
            file.unlink(missing_ok=True)
            return None

    def load_counts(self, source: str, block: int) -> dict[str, Any] | None:
        """The engine's counters of the work that (source, block) took (saved with it), or None."""
        return self._read_json(f"{source}-counts-{block:06d}.json")

    def discard(self, source: str, block: int) -> None:
        """A (source, block) column dropped, to be replayed."""
        self.block_file(source, block).unlink(missing_ok=True)
        (self.path / f"{source}-counts-{block:06d}.json").unlink(missing_ok=True)

    def _create(self) -> None:
        """The dir and its manifest, at the first save (bad input must leave nothing behind)."""
        if not (self.path / "manifest.json").is_file():
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path / "manifest.json", json.dumps(json_safe(self.manifest), indent=1) + "\n")

    def save(self, source: str, block: int, logp: np.ndarray, counts: dict[str, Any] | None = None) -> None:
        """A (source, block) column, with `counts`, the engine's counters of the work it took,
        written first: a block whose log-probs were saved always has its counters too, so a resumed
        run reports the work one run did (replay/passes.py)."""
        self._create()
        if source in self._facts and not (self.path / f"{source}-engine.json").is_file():
            atomic_write_text(self.path / f"{source}-engine.json", json.dumps(self._facts[source]) + "\n")
        if counts is not None:
            self._write_json(f"{source}-counts-{block:06d}.json", counts)
        self._write_binary(self.block_file(source, block),
                           lambda handle: np.save(handle, logp, allow_pickle=False))

    def _write_binary(self, file: Path, write: Callable[[Any], None]) -> None:
        """`write(handle)` into a temp file renamed to `file`: a kill mid-write leaves a temp
        file (removed with the work dir), never a short block."""
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.tmp-", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def save_routing(self, source: str, block: int, routed: list[Any]) -> None:
        """A block's MoE routing (streams.StreamRouting per request), beside its log-probs."""
        self._create()
        self._write_binary(self.path / f"{source}-routing-{block:06d}.npz", lambda handle: np.savez(
            handle, lengths=np.array([len(r.experts) for r in routed], dtype=np.int64),
            experts=np.concatenate([r.experts for r in routed]), margin=np.concatenate([r.margin for r in routed])))

    def load_routing(self, source: str, block: int) -> list[Any] | None:
        from mismatch.streams import StreamRouting

        file = self.path / f"{source}-routing-{block:06d}.npz"
        if not file.is_file():
            return None
        try:
            with np.load(file, allow_pickle=False) as saved:
                cuts = np.cumsum(saved["lengths"])[:-1]
                return [StreamRouting(experts=e, margin=m) for e, m in
                        zip(np.split(saved["experts"], cuts), np.split(saved["margin"], cuts))]
        except (ValueError, OSError, EOFError, KeyError):
            file.unlink(missing_ok=True)  # cut or foreign: replayed again (see load)
            return None

    def _write_json(self, name: str, data: dict[str, Any]) -> None:
        self._create()
        atomic_write_text(self.path / name, json.dumps(json_safe(data)) + "\n")

    def _read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the work dir, or None when it is missing or unreadable (then redone)."""
        try:
            return json.loads((self.path / name).read_text()) if (self.path / name).is_file() else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def save_stage(self, name: str, result: dict[str, Any]) -> None:
        """A finished stage after the replays (the model localizers), so a rerun after a kill
        during a later stage does not redo it."""
        self._write_json(f"stage-{name}.json", result)

    def load_stage(self, name: str) -> dict[str, Any] | None:
        return self._read_json(f"stage-{name}.json")

    def save_described(self, source: str, described: dict[str, Any]) -> None:
        """The engine's describe() once its blocks are done: a resume that replays nothing for a
        source still reports the engine as it was (resolved options, semantics), as one run would."""
        if self.path.is_dir():
            self._write_json(f"{source}-described.json", described)

    def load_described(self, source: str) -> dict[str, Any] | None:
        return self._read_json(f"{source}-described.json")

    def check_engine(self, source: str, facts: dict[str, Any]) -> None:
        """Refuse to mix blocks from an engine that reports itself differently (an HTTP server now
        serving another model or version, "auto" resolving to another dtype); remember the facts."""
        file = self.path / f"{source}-engine.json"
        facts = json_safe(facts)
        previous = json.loads(file.read_text()) if file.is_file() else None
        if previous is not None and previous != facts and any(self.path.glob(f"{source}-*.npy")):
            changed = sorted(key for key in set(previous) | set(facts) if previous.get(key) != facts.get(key))
            raise ResultsError(f"{self.path}: its {source} blocks came from an engine reporting "
                               f"{', '.join(f'{k}={previous.get(k)!r}' for k in changed)}; it now reports "
                               f"{', '.join(f'{k}={facts.get(k)!r}' for k in changed)}; pass --force to "
                               "discard those blocks")
        self._facts[source] = facts

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
