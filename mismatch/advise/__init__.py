"""From measured gaps to what to do (ARCHITECTURE.md, "Advise").

`diagnose` turns the evidence (read by `readers`) into ranked causes; `verdicts` words each pair's
gap (`levels`) and ends with its cause; `corrections` simulates every importance-sampling
correction the frameworks offer (`correction_modes`) on the user's own tokens
(`correction_tokens`); `recommend` fixes each cause at its source and picks a correction
(`evidence`, `choice`); `snippets` renders them for a framework release; `advice.advise` writes all
of it into summary.json, `advice.for_target` answers `mismatch recommend`; `gate` turns a results
dir into a CI exit code.
"""
