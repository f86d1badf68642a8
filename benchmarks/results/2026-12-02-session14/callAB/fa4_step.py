"""benchmarks/drafter.py with the drafter's flex-attention on its FLASH backend (flash-attn-4's CuTe
kernels) in place of Inductor's Triton kernel; every argument passes through."""
import runpy
import sys

import dflash_cache.drafter.attention as attention

attention.KERNEL_OPTIONS = {"BACKEND": "FLASH"}
sys.argv = ["benchmarks/drafter.py", *sys.argv[1:]]
runpy.run_path("benchmarks/drafter.py", run_name="__main__")
