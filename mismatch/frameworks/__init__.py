"""What mismatch knows about each RL trainer, one module per framework (README.md here: the
protocol, protocol.py): the releases it has read, the correction each release can express, the
config keys its snippets use (advise/ renders them) and the metrics it logs under its own names
(metrics.py computes them on the token table). Each fact is cited to the release it was read from;
tests/test_releases.py loads every snippet into the released package itself."""

from __future__ import annotations

from mismatch.frameworks.protocol import Framework, FrameworkMetric, Recommendation, Release, Target
from mismatch.frameworks.registry import (
    FRAMEWORKS,
    MODULES,
    REGISTERED,
    default_target,
    installed_version,
    module,
    parse_target,
)

__all__ = ["FRAMEWORKS", "MODULES", "REGISTERED", "Framework", "FrameworkMetric", "Recommendation", "Release",
           "Target", "default_target", "installed_version", "module", "parse_target"]
