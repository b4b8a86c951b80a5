"""The HTML report of a results dir (and of a run's trend): what the rest of mismatch may call.

`build_report(DIR)` writes DIR/index.html; a command that reads its tokens anyway runs the page's
`DigestAnalysis` in its own passes and hands it over. The modules behind these are the report's
own; the words and numbers it shares with the terminal live in `mismatch.present`.
"""

from mismatch.reports.build import build_report
from mismatch.reports.digest import DigestAnalysis
from mismatch.reports.trend import build_trend_report
from mismatch.reports.worst import WorstOptions

__all__ = ["DigestAnalysis", "WorstOptions", "build_report", "build_trend_report"]
