"""Evaluate a drafter: real greedy speculative decoding with its target, or τ offline from a cache.

decode.py (greedy and speculative loops) · speculative.py (held-out prompts, checked against greedy) ·
offline.py (τ from cached hidden states, as the trainer computes it) · drafters.py (checkpoint, run
or export folders) · prompts.py
"""

from dflash_cache.eval.offline import OfflineOptions, OfflineReport, evaluate_offline
from dflash_cache.eval.speculative import SpeculativeOptions, SpeculativeReport, evaluate_speculative

__all__ = [
    "OfflineOptions",
    "OfflineReport",
    "SpeculativeOptions",
    "SpeculativeReport",
    "evaluate_offline",
    "evaluate_speculative",
]
