"""The names of a results dir's files and of its summary's schema, and the test that a dir is one.

Every command that writes or reads a results dir takes these names from here (ARCHITECTURE.md,
"Results dir", says what each file holds).
"""

from __future__ import annotations

import json
from pathlib import Path

SUMMARY_SCHEMA = "mismatch.summary/v1"
SUMMARY_FILE = "summary.json"          # the numbers (schema: SCHEMA_FILE)
TOKENS_FILE = "tokens.parquet"         # one row per replayed token
ROLLOUTS_FILE = "rollouts.parquet"     # the pair metrics per rollout
REPORT_FILE = "index.html"             # the report (reports/)
DEPENDENCY_LOG = "dependencies.log"    # what the dependencies printed during the run
SCHEMA_FILE = Path(__file__).parent.parent / "data" / "summary.schema.json"

# A results dir that is a mount point (a container volume: `-v …:/out --out /out`) cannot be
# renamed; its files are staged inside it under this prefix and moved in one by one.
STAGE_IN_PLACE = ".mismatch-stage-"


def is_results_dir(path: Path) -> bool:
    summary = path / SUMMARY_FILE
    if not summary.is_file():
        return False
    try:
        return json.loads(summary.read_text()).get("schema") == SUMMARY_SCHEMA
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
