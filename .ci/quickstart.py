"""Print the README's two quickstart commands, one per line (used by .ci/run and the tests)."""

import re
import sys
from pathlib import Path

block = re.search(r"<!-- quickstart -->\s*```(?:bash|sh)?\n(.*?)```", Path(sys.argv[1]).read_text(), re.S)
if block is None:
    sys.exit("README.md: no <!-- quickstart --> code block")
commands = [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]
if len(commands) != 2:
    sys.exit(f"README.md: the quickstart must be exactly two commands, found {len(commands)}")
print("\n".join(commands))
