"""What mismatch says about a results dir, in words and numbers: the headline, the causes and
verdicts as lines, the numbers as people read them. Below both the CLI and the HTML report, so
the terminal and the page word one finding the same way; it prints and renders nothing itself.

`numbers` formats a number (the page's `num`/`pct`, the terminal's `plain`); `headline` turns a
summary into its verdict (`Banner`); `trend` words a run over its steps.
"""
