"""What mismatch says about a results dir, in words and numbers: the headline, the causes and
verdicts as lines, the numbers as people read them. Below both the CLI and the HTML report, so
the terminal and the page word one finding the same way; it prints and renders nothing itself.

`numbers` formats a number (the page's `num`/`pct`/`formatted`, the terminal's `plain`);
`headline` turns a typed summary (results/summary_model.py) into its verdict (`Banner`) and words
a cause, a verdict, the clip range and split prefixes; `views` reads the sections the summary keeps
open as records; `trend` reads a run over its steps as records and words it.
"""
