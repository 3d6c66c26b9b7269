#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA GPU, PyTorch and Triton (no vLLM needed, no network):
# 1. every test that launches a Triton kernel, on CUDA tensors (compiled kernels, not Triton's interpreter), among
#    them tests/test_sparse_gpu_filter.py: DIPR as a filter in front of FlashAttention (the sketch scan's read mask,
#    the pruned tables, a CUDA graph replay; the FlashAttention cases run only where vLLM's CUDA build is installed);
# 2. benchmarks/sparse_decode_gpu.py (DIPR decode, the filter in front of FlashAttention's paged decode, and the
#    paged prefill, against FlashAttention, real and synthetic keys), which writes
#    build/benchmarks/sparse_decode_gpu.json and .png (through benchmarks/harness.py) and prints issue 28's GPU goals;
#    without an importable FlashAttention (vLLM's or the flash_attn package) it says so, times dense decode by torch's
#    scaled_dot_product_attention only, and judges the goals from the filter's own cost against it (as bounds).
# Usage, from the repository root: bash benchmarks/gpu_check.sh [OUTDIR]  (logs and results are copied to OUTDIR).
set -uo pipefail
out=${1:-build/gpu_check}
mkdir -p "$out"

# kvreuse as pyproject's package-dir lays it out (the kernels are kvreuse.kernels), without pip: a lent GPU machine
# has its own PyTorch and Triton and may reach no package index (kvreuse's other run-time needs, pydantic and
# pydantic-settings among them, must be on PYTHONPATH already).
site=$(mktemp -d)
mkdir -p "$site/kvreuse"
cp -r plugins/kvreuse/. "$site/kvreuse/"
cp -r triton_kernels "$site/kvreuse/kernels"
cp -r patches "$site/kvreuse/patches"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' || exit 1
python3 -c 'import vllm.vllm_flash_attn' 2>/dev/null && echo "vLLM's FlashAttention: importable" ||
  echo "vLLM's FlashAttention: not importable (its tests skip; the benchmark tries the flash_attn package)"
KERNEL_TESTS="tests/test_sparse_kernels.py tests/test_paged_causal_kernel.py tests/test_paged_write_kernel.py
  tests/test_rerotate.py tests/test_sparse_real_keys.py tests/test_numerics.py tests/test_sparse_cpu_attention.py
  tests/test_splice_reference.py tests/test_sparse_backend_pieces.py tests/test_sparse_gpu_filter.py"
# -P: the repository root stays off sys.path (its triton_kernels/ folder is not the package).
# shellcheck disable=SC2086
python3 -P -m pytest -p no:cacheprovider -q $KERNEL_TESTS 2>&1 | tee "$out/kernel_tests.log"
tests=${PIPESTATUS[0]}
python3 benchmarks/sparse_decode_gpu.py 2>&1 | tee "$out/sparse_decode_gpu.log"
bench=${PIPESTATUS[0]}
cp build/benchmarks/sparse_decode_gpu.json build/benchmarks/sparse_decode_gpu.png "$out/" 2>/dev/null
echo "kernel tests exit $tests, benchmark exit $bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
