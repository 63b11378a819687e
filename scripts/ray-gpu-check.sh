#!/usr/bin/env bash
# On the two-GPU CUDA machine: budgeted Ray actors on the real GPUs and the host ledger.
# Installs PyCUDA and gpubudget's pure-Python needs from the ignored .whl/ folder (see
# scripts/gpu-check.sh) and Ray from the ignored .raywhl/ folder (python3 scripts/ray_wheel.py
# where a registry answers: Ray's cp312 wheel without ray/jars/ and the four dependencies the
# GPU image lacks, ~45 MiB), then runs tests/gpu/test_ray_gpu.py, the host ledger's CPU tests
# (with real processes) and `gpubudget top --once` of the ledger the actors used. Output goes
# to ${OUT:-gpu-out}/ as well as to the terminal.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl .raywhl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GPUBUDGET_RAY_OUT=$out
{ date -u; nvidia-smi -L; python3 --version;
  python3 -c 'import ray, pycuda; print("ray", ray.__version__, "pycuda", pycuda.VERSION_TEXT)';
  python3 -c 'import pynvml; print("nvidia-ml-py", pynvml.__version__ if hasattr(pynvml, "__version__") else "present")' || true
} 2>&1 | tee "$out/ray-machine.txt"
python3 -m pytest tests/gpu/test_ray_gpu.py -v -p no:cacheprovider 2>&1 | tee "$out/ray-gpu-tests.txt"
status=${PIPESTATUS[0]}
python3 -m pytest tests/test_hostledger_claims.py tests/test_top.py tests/test_metrics.py -q \
  -p no:cacheprovider 2>&1 | tail -n 5 | tee "$out/ledger-cpu-tests.txt"
for file in ray-top.txt ray-refused.txt; do
  [ -f "$out/$file" ] && { echo "== $file"; cat "$out/$file"; }
done
exit "$status"
