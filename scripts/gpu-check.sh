#!/usr/bin/env bash
# On a CUDA machine (one or two GPUs): install PyCUDA and gpubudget's pure-Python needs from the
# ignored .whl/ folder, run the whole test suite (the GPU tests verbose), the soak
# (scripts/soak.py), the demo traced and fitted, and the GPU benchmarks. Output goes to
# ${OUT:-gpu-out}/ as well as to the terminal.
#   mkdir -p .whl && cp ../shared/wheels/device-cp312/*.whl .whl/
#   pip download --no-deps -d .whl contextvars-extras==0.7.0 "sentinel-value<2"
#   bash scripts/gpu-check.sh        (GPUBUDGET_PURE=1 to run the pure-Python core;
#                                     SOAK_MINUTES=n for the soak's length, 0 to skip it)
# The core's C extension is built in place first (gcc and Python's headers), as pip would.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -z "${GPUBUDGET_PURE:-}" ]; then
  python3 setup.py -q build_ext --inplace > "$out/build.txt" 2>&1 || tail -n 20 "$out/build.txt"
fi
python3 -c 'import gpubudget; print("gpubudget core:", "C (_native)" if gpubudget.compiled else "pure Python")' | tee "$out/core.txt"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; python3 --version;
  python3 -c 'import pycuda, cupy, torch; print("pycuda", pycuda.VERSION_TEXT, "cupy", cupy.__version__, "torch", torch.__version__)'; } 2>&1 | tee "$out/machine.txt"
python3 -m pytest tests/gpu -v -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.txt"
tests=${PIPESTATUS[0]}
# the soak: threads loading, serving, failing and unloading models in budgets at random, on this
# run's core (the script is run once per core); SOAK_MINUTES=0 skips it
core=$(python3 -c 'import gpubudget; print("c" if gpubudget.compiled else "pure")')
if [ "${SOAK_MINUTES:-2}" != 0 ]; then
  python3 -m scripts.soak --minutes "${SOAK_MINUTES:-2}" 2>&1 | tee "$out/soak-$core.txt"
  soak=${PIPESTATUS[0]}
  python3 -m scripts.soak --measure 5000 2>&1 | tee "$out/mempool-cost-$core.txt"
  [ "$tests" = 0 ] && tests=$soak
fi
python3 -m pytest tests -q -p no:cacheprovider --ignore=tests/gpu --tb=short > "$out/cpu-tests.txt" 2>&1
tail -n 15 "$out/cpu-tests.txt"
GPUBUDGET_TRACE="$out/demo-trace.jsonl" python3 -m gpubudget demo --plot "$out/demo-gpu.png" 2>&1 | tee "$out/demo.txt"
python3 -m gpubudget fit "$out/demo-trace.jsonl" 2>&1 | tee -a "$out/demo.txt"
python3 -m benchmarks.gpu --repeat 3 2>&1 | tee "$out/gpu-bench.md"
python3 -m benchmarks.model_load --repeat 3 2>&1 | tee "$out/model-load.md"
python3 -m benchmarks.fragmentation --seeds 3 2>&1 | tee "$out/fragmentation.md"
if [ -f .scratch/bare_bestfit.py ]; then  # the team's CPU baseline, if it was carried along
  python3 -m benchmarks.churn --baseline .scratch/bare_bestfit.py 2>&1 | tee "$out/churn-cpu.md"
fi
exit "$tests"
