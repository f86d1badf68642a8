"""benchmarks/drafter.py with the LM-head loss's per-row math in torch (head_loss.reference_terms, as
before session 14) in place of the Triton kernel; every argument passes through."""
import runpy
import sys

import dflash_cache.drafter.model as model
from dflash_cache.drafter.head_loss import reference_terms

model.chunk_terms = reference_terms
sys.argv = ["benchmarks/drafter.py", *sys.argv[1:]]
runpy.run_path("benchmarks/drafter.py", run_name="__main__")
