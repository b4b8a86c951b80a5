"""Localizers: where the gap between two engines comes from — by turn, by layer, by kernel.

After metrics in the flow; each module fills one key of `summary.json["localization"]`.
"""
