"""The analysis: a filled token table in, summary.json's numbers out (ARCHITECTURE.md, "Analyze").

`terms` defines each per-token term once; `tokenview` and `groups` cut the table into key spans;
`pair_tokens` pairs two log-prob columns, `span_sums` sums their terms per span and group, and
`metrics` turns the sums into PAIR_METRICS. `chunked` reads the table chunk by chunk for every
analysis at once (`run_passes`): `grouped_metrics` (per pair and breakdown), `per_rollout`,
`counts`, `trees` (under the trainer's tree weights), `comparison` (diff's two configs), and the
mergeable reductions they are made of (`tails`, `radix_select`, `moments`). `clip` measures the gap
against the PPO clip range; `alignment` checks the stored and replayed streams line up (shifts,
padding, processed log-probs); `routing` and `prefixes` judge MoE routing and prefix consistency.
"""
