#!/usr/bin/env bash
# On a CUDA machine: the driver door against the real libraries, in one call per phase.
#   phase "libs":   PyTorch, JAX (two allocators), NCCL, CuPy (pool off), Numba, TensorRT's lean
#                   runtime under `gpubudget run` (python -m scripts.door_gpu all), the
#                   hooked/unhooked pair on the real driver, and the Numba / cuda.core doors'
#                   GPU tests;
#   phase "models": the many-models GPU test and the soak on both cores under the door;
#   phase "bench":  python -m benchmarks.gpu and benchmarks.model_load with and without it.
# Wheels as for scripts/gpu-check.sh, in .whl/ (TensorRT's lean cu13 wheels may be added to it).
#   bash scripts/door-check.sh libs|models|bench      (output also under ${OUT:-gpu-out}/)
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?libs, models or bench}
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 setup.py -q build_ext --inplace > "$out/build.txt" 2>&1 || tail -n 20 "$out/build.txt"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 -c 'import gpubudget; print("gpubudget core:", "C" if gpubudget.compiled else "pure")'
  python3 -m gpubudget run --print-library; } 2>&1 | tee "$out/machine-$phase.txt"
status=0
case "$phase" in
libs)
  timeout 420 python3 -m scripts.door_gpu all --timeout 150 2>&1 | tee "$out/door-libs.md" || status=1
  timeout 120 python3 -m pytest tests/gpu/test_doors_gpu.py -v -p no:cacheprovider 2>&1 | tail -n 25 | tee "$out/doors-gpu.txt" || status=1
  ;;
models)
  timeout 150 python3 -m gpubudget run -- python3 -m pytest tests/gpu/test_many_models_gpu.py -v -p no:cacheprovider 2>&1 | tail -n 20 | tee "$out/many-models-door.txt" || status=1
  for core in c pure; do
    pure=$([ $core = pure ] && echo 1 || echo "")
    GPUBUDGET_PURE=$pure timeout $(( ${SOAK_MINUTES:-1} * 60 + 90 )) python3 -m gpubudget run -- python3 -m scripts.soak --growable --minutes "${SOAK_MINUTES:-1}" 2>&1 | tail -n 30 | tee "$out/soak-door-$core.txt" || status=1
  done
  ;;
bench)
  for run in plain door; do
    pre=$([ $run = door ] && echo "python3 -m gpubudget run --" || echo "")
    timeout 80 $pre python3 -m benchmarks.model_load --repeat 3 2>&1 | tee "$out/model-load-$run.md"
    timeout 80 $pre python3 -m benchmarks.gpu --repeat 2 2>&1 | tee "$out/gpu-bench-$run.md"
  done
  ;;
esac
exit $status
