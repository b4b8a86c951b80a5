"""The analysis: a filled token table in, summary.json's numbers out (ARCHITECTURE.md, "Analyze").

`terms` defines each per-token term once; `tokenview` and `groups` cut the table into key spans;
`metrics` reduces the terms per pair and group; `framework_metrics` recomputes them under each
trainer's own names; `clip` measures the gap against the PPO clip range; `alignment` checks the
stored and replayed streams line up (shifts, padding, processed log-probs).
"""
