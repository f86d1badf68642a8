# (scripts moved under callAB/ after the runs; paths updated)
# Session 14 call A: unpack flash-attn-4's MLIR library (carried alone, .fa4a) into /tmp/fa4site for call B.
D=/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs
mkdir -p $D && xz -dc .fa4a/ir.xz > $D/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so && ls -la $D
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader; python3 --version
