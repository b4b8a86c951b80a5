"""What mismatch knows about each RL trainer, one module per framework: the config keys its
snippets use (advise/recommend.py renders them) and the metrics it logs under its own names
(analysis/framework_metrics.py computes them). Each module cites the file and commit it was read
from; tests/framework_schemas.py checks every snippet against a transcription of its schema."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from mismatch.frameworks import openrlhf, prime_rl, slime, trl, verl

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation

FRAMEWORKS = ("verl", "trl", "slime", "prime-rl", "openrlhf")
MODULES: dict[str, ModuleType] = {"verl": verl, "trl": trl, "slime": slime, "prime-rl": prime_rl,
                                  "openrlhf": openrlhf}


def renderer(name: str) -> Callable[[dict[str, Recommendation]], list[str]] | None:
    module = MODULES.get(name)
    return module.render if module is not None else None
