"""The gradient norm over the 27B drafter's gradients (bf16 matrices, fp32 vectors, as train has them):
train's gradient_norm (per-tensor fp32 norms) against torch._foreach_norm in the gradients' dtype and a
compiled sum of squares; mean ms over 20 after warm-up, and each value's relative difference."""
import torch

from benchmarks.profiling import cuda_mean_ms
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.train.optim import gradient_norm

config = load_drafter_config("qwen3.6-27b")
with torch.device("meta"):
    shapes = [(p.shape, p.dim() >= 2) for p in DFlashDrafter(config).parameters()]
g = torch.Generator("cuda").manual_seed(0)
grads = [torch.randn(s, device="cuda", generator=g).mul_(1e-3).to(torch.bfloat16 if matrix else torch.float32)
         for s, matrix in shapes]
params = [torch.nn.Parameter(torch.empty_like(x)) for x in grads]
for p, grad in zip(params, grads):
    p.grad = grad
gb = sum(x.numel() * x.element_size() for x in grads) / 1e9
squares = torch.compile(lambda gs: torch.stack([x.float().square().sum() for x in gs]).sum().sqrt())
variants = {
    "train's gradient_norm": lambda: gradient_norm(params),
    "_foreach_norm, own dtype": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)).float()),
    "compiled sum of squares": lambda: squares(grads),
}
want = gradient_norm(params).item()
for name, fn in variants.items():
    ms = cuda_mean_ms(fn, 20, 3)
    print(f"{name:<26} {ms:6.3f} ms ({gb / ms:.2f} TB/s over {gb:.2f} GB)  value {fn().item():.6f} "
          f"(relative {fn().item() / want - 1:+.1e})")
