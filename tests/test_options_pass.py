"""One options pass (issue 49, item 2): a command's options are resolved once, at the edge, into a
frozen object marked `resolved`; the pipeline given resolved options resolves nothing again, and
options given unresolved (the library's own callers) are resolved there, once."""

from __future__ import annotations

import dataclasses

import pytest

from mismatch.pipeline import configured
from mismatch.pipeline.configured import resolve_options
from mismatch.pipeline.options import AuditOptions
from test_golden import GOLDEN, stored_checkpoint


def test_resolved_options_are_not_resolved_again(tmp_path, monkeypatch):
    from mismatch.pipeline.audit import run_audit

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    asked = AuditOptions(train="stored:trainer", infer="stored:engine", out=tmp_path / "out", block_size=64)
    resolved = resolve_options(checkpoint, asked)
    assert resolved.resolved and not asked.resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.train = "hf"  # type: ignore[misc]

    calls = []
    monkeypatch.setattr(configured, "with_configs", lambda options: calls.append(options) or options)
    assert resolve_options(checkpoint, resolved) is resolved
    result = run_audit(checkpoint, GOLDEN / "rollouts.jsonl", resolved)
    assert calls == []  # the pipeline resolved nothing: the edge had
    assert result.record.command == "audit" and (tmp_path / "out" / "summary.json").is_file()
    resolve_options(checkpoint, asked)  # options not resolved yet are, once
    assert len(calls) == 1
