"""From measured gaps to what to do (ARCHITECTURE.md, "Advise").

`verdicts` words each pair's gap; `corrections` simulates every importance-sampling correction the
frameworks offer on the user's own tokens; `recommend` picks by the rule and renders each
framework's config; `gate` turns a results dir into a CI exit code.
"""
