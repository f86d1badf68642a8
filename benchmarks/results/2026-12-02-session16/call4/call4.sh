# Session 16 call 4 (call 3's warm machine): the GPU tests that call 2's 240 s did not reach; the optimizer
# step alone (its bf16 variant failed: CompiledAdamW then required a group to be all matrices or all
# vectors, which build_optimizer's groups are and this benchmark's single group is not; fixed after).
source benchmarks/results/2026-12-02-session11/env.sh >/dev/null 2>&1
step gputests_rest 100 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/test_drafter_gpu.py::test_head_loss_kernel_matches_the_torch_reference" tests/test_drafter_gpu.py::test_train_builds_the_drafter_on_the_gpu_from_its_seed
step optimizer 120 python3 benchmarks/optimizer.py
