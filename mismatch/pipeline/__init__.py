"""The flow ARCHITECTURE.md draws, as stages the three commands compose:

    load and check → plan → replay → store → analyze → localize → diagnose and advise → publish

`stages.py` holds the stages every command shares (typed inputs and outputs), `summary.py` builds
summary.json once from their results, and `audit.py`, `diff.py` and `merge.py` compose them. The
options a command takes travel as one frozen object (`options.py`), not as a keyword chain.
"""
