"""Dump hooks: the smallest thing a user adds to a TRL, OpenRLHF or AReaL run so its rollouts reach
mismatch (none of the three writes token ids with the sampler's log-probs to disk). Each hook
hands its framework's own tensors to `dump.StepDump`, which writes format v1 as the run goes.

Imported inside the user's training process: nothing here imports torch or a framework at module
level; each hook module imports its framework when it is used.
"""
