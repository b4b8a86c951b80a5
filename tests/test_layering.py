"""The house rules, read from the source: imports go downward only (tests/layering.py) and every
package is installed. No line caps: an algorithm reads top to bottom with a docstring that defines
its terms, rather than cut into pieces to fit a count."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import layering  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_imports_go_downward_only_and_nothing_cycles():
    assert layering.violations(REPO) == []


@pytest.fixture()
def copied(tmp_path: Path) -> Path:
    for name in ("mismatch", "probes", "reports"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_a_planted_upward_import_is_caught_even_inside_a_function(copied: Path):
    target = copied / "mismatch" / "errors.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from mismatch.analysis import terms\n"
                      "    return terms\n")
    found = layering.violations(copied)
    assert len(found) == 1 and "mismatch/errors.py" in found[0] and "upward: errors is below analysis" in found[0]


def test_a_planted_cycle_and_a_report_reaching_an_engine_are_caught(copied: Path):
    sections = copied / "reports" / "html.py"
    sections.write_text(sections.read_text() + "\nfrom mismatch.engines import spec as _spec  # noqa\n")
    terms = copied / "mismatch" / "analysis" / "terms.py"
    terms.write_text(terms.read_text() + "\n\ndef _planted():\n    from mismatch.analysis import metrics\n")
    found = layering.violations(copied)
    assert any("mismatch.reports.html imports mismatch.engines.spec (forbidden" in line for line in found), found
    assert any(line.startswith("cycle:") and "mismatch.analysis.terms" in line for line in found), found


def test_a_reach_into_the_reports_modules_is_caught(copied: Path):
    """The CLI and the pipeline call the report through `mismatch.reports`; its modules are its own."""
    target = copied / "mismatch" / "cli" / "printing.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from mismatch.reports.sections import footer\n"
                      "    return footer\n")
    found = layering.violations(copied)
    assert len(found) == 1 and "mismatch.cli.printing imports mismatch.reports.sections" in found[0] \
        and "(internal: outside reports" in found[0], found


def test_every_package_is_installed():
    """pyproject lists its packages (probes/ and reports/ map into mismatch): a new folder must be added."""
    listed = set(layering.tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, file in layering.project_modules(REPO).items() if file.name == "__init__.py"}
    assert listed == packages


def test_import_mismatch_and_help_load_no_heavy_dependency():
    """`import mismatch` and `mismatch --help` load neither pandas, torch nor vLLM (ARCHITECTURE.md):
    the CLI's modules import the library inside their commands."""
    import json
    import subprocess

    code = ("import json, sys\nimport mismatch\nsys.argv = ['mismatch', '--help']\nfrom mismatch.cli import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "print('\\nLOADED', json.dumps(sorted({name.split('.')[0] for name in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = set(json.loads(out.rsplit("LOADED", 1)[1]))
    assert "Usage" in out and "audit" in out
    assert loaded.isdisjoint({"pandas", "torch", "vllm", "pyarrow", "transformers"}), loaded & {"pandas", "torch", "vllm"}
