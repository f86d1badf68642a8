# sourced on the device after session 11's env.sh: flash-attn-4 (CuTe DSL) for flex-attention's FLASH backend.
# Its 193 MB MLIR library travels alone in an earlier call (.fa4a, xz) that unpacks it into /tmp/fa4site
# (the working tree may carry 64 MiB a call); this call carries the rest (.fa4b).
SO=/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
[ -s $SO ] || { echo "no $SO: the .fa4a call did not run on this machine"; exit 1; }
tar -xJf .fa4b/rest.tar.xz -C /tmp/fa4site && xz -dc .fa4b/rt.xz > /tmp/fa4site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so || exit 1
export PYTHONPATH=/tmp/site:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PWD
python3 -c "import flash_attn.cute.interface, cutlass; print('flash-attn-4 imports; cutlass', cutlass.__version__ if hasattr(cutlass, '__version__') else '?')" 2>&1 | tail -3
