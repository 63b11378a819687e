#!/usr/bin/env bash
# Other people's test suites with every test inside a budget, on a CUDA machine (one H200: about
# 6 to 8 minutes). First a slice of CuPy's own test suite, four times with pytest-xdist:
#   tight  each test inside a 1 MiB root budget + gpubudget.cupy.allocations() (runs first, on
#          TIGHT_WORKERS workers: it also fills CuPy's kernel cache for the runs after it),
#   off    unrouted (the same plugin records the outcomes),
#   root   each test inside its own 16 GiB root budget + allocations(),
#   child  each test inside a 16 GiB child of one 16 GiB root per worker process,
# then compares them (scripts/suites/compare.py): counts, identical outcomes (the differing tests
# listed), check() after every test, hangs, what held budgets, wall times, the per-test overhead
# of routing; and with 1 MiB, that every failure the unrouted run did not have is a clean
# OutOfMemoryError naming the budget. Then PyTorch's OpInfo samples on CUDA, (a) unrouted,
# (b) routed, (c) in 1 MiB (scripts/suites/opinfo.py), with its table. Output: ${OUT:-gpu-out}/
# summary.md (every table), gpu-suites.log (all of it), cupy-summary.json, opinfo.json and
# cupy-runs.tar.gz (each run's outcome file and pytest log).
#
# CuPy's tests are not in this repository (none of its code may be). Make them once from a
# fetched CuPy repository, at the tag of the installed CuPy (python3 -c 'import cupy;
# print(cupy.__version__)' -> 14.2.0), into the git-ignored .suites/ folder, and carry it:
#   git clone --bare https://github.com/cupy/cupy.git /tmp/cupy.git    # or any fetched copy
#   mkdir -p .suites/cupy-v14.2.0
#   git --git-dir=/tmp/cupy.git archive v14.2.0 tests pyproject.toml | tar -x -C .suites/cupy-v14.2.0
# pyproject.toml holds CuPy's pytest settings (strict xfail, markers, warnings as errors); without
# it the script writes those settings itself. PyTorch's OpInfo database ships inside torch; its
# test helpers import expecttest, for which opinfo.py stands in where it is not installed.
# Needs: CUDA, CuPy, PyTorch, PyCUDA, pytest-xdist, pytest-timeout; gpubudget importable (the
# repository on PYTHONPATH). Runs as is: bash scripts/gpu-suites.sh
#
# Settings (environment, defaults):
#   CUPY_TESTS=.suites/cupy-v14.2.0/tests    CuPy's tests folder
#   SELECTION=...                           pytest arguments, paths relative to CUPY_TESTS (below)
#   RUNS="tight off root child"             the CuPy runs, in this order
#   WORKERS=8 TIGHT_WORKERS=16              xdist workers (8 x 16 GiB roots fit an H200)
#   LIMIT=16GiB TIGHT=1MiB                  each test's budget; the child mode's root is LIMIT too
#   TEST_TIMEOUT=60                         a test running longer ends its worker (stacks dumped)
#   CUPY_SECONDS=300                        all CuPy runs together; each is stopped at its share
#                                           (the first run twice the others', unused time passed on)
#   OPINFO_SECONDS=110 OPINFO_DTYPES=float32,bfloat16,int64 OPINFO_ARGS=   opinfo.py's
#   SKIP_CUPY=1 SKIP_OPINFO=1               leave a part out
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suites.XXXXXX")
exec > >(tee -a "$out/gpu-suites.log") 2>&1
tee_pid=$!
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GPUBUDGET_BACKEND=${GPUBUDGET_BACKEND:-pycuda}

CUPY_TESTS=${CUPY_TESTS:-.suites/cupy-v14.2.0/tests}
# The modules of issue 15 (5,943 tests with -m 'not slow'): test_arithmetic.py's unary and
# first binary classes (its Binary2/Binary3 classes add 4,800 more dtype pairs of the same
# operators), and of the FFT tests the 1-D, 2-D and n-D transforms, the plan context manager
# and the plan cache (test_callback.py compiles cuFFT callbacks: minutes; leave it out).
c=cupy_tests
SELECTION=${SELECTION:-"$c/core_tests/test_ndarray_elementwise_op.py $c/core_tests/test_ndarray_reduction.py \
$c/creation_tests/test_basic.py $c/manipulation_tests/test_shape.py \
$c/math_tests/test_arithmetic.py::TestArithmeticUnary $c/math_tests/test_arithmetic.py::TestArithmeticBinary \
$c/linalg_tests/test_product.py $c/sorting_tests/test_sort.py \
$c/fft_tests/test_fft.py::TestFft $c/fft_tests/test_fft.py::TestFft2 $c/fft_tests/test_fft.py::TestFftn \
$c/fft_tests/test_fft.py::TestRfft $c/fft_tests/test_fft.py::TestPlanCtxManagerFft $c/fft_tests/test_cache.py \
-m 'not slow'"}
RUNS=${RUNS:-"tight off root child"}
WORKERS=${WORKERS:-8}
TIGHT_WORKERS=${TIGHT_WORKERS:-16}
LIMIT=${LIMIT:-16GiB}
TIGHT=${TIGHT:-1MiB}
TEST_TIMEOUT=${TEST_TIMEOUT:-60}
CUPY_SECONDS=${CUPY_SECONDS:-300}
OPINFO_SECONDS=${OPINFO_SECONDS:-110}
OPINFO_DTYPES=${OPINFO_DTYPES:-float32,bfloat16,int64}
OPINFO_ARGS=${OPINFO_ARGS:-}
started=$(date +%s)
status=0

echo "== gpu-suites $(date -u +%Y-%m-%dT%H:%M:%SZ) (work files: $work)"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 --version; nproc
  python3 - <<'EOF'
import importlib
for name in ("gpubudget", "cupy", "torch", "pycuda", "pytest", "xdist", "pytest_timeout"):
    try:
        module = importlib.import_module(name)
        version = getattr(module, "__version__", None) or getattr(module, "VERSION_TEXT", "?")
        extra = ""
        if name == "gpubudget":
            extra = " (core: " + ("compiled)" if module.compiled else "pure Python)")
        print(f"{name} {version}{extra}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
EOF
} | tee "$work/machine.txt"

has() { python3 -c "import $1" 2>/dev/null; }

# -- CuPy's suite -------------------------------------------------------------------------------
cupy_md=""
if [ -n "${SKIP_CUPY:-}" ]; then
  echo "== CuPy: skipped (SKIP_CUPY)"
elif [ ! -d "$CUPY_TESTS" ]; then
  echo "== CuPy: no tests at $CUPY_TESTS; make them as this script's header says (git archive)"
  status=1
else
  tests=$(cd "$CUPY_TESTS" && pwd)
  suite_root=$(dirname "$tests")
  ini="$suite_root/pyproject.toml"
  if [ ! -f "$ini" ]; then
    ini="$work/cupy-pytest.ini"
    cat > "$ini" <<'EOF'
[pytest]
# CuPy's own pytest settings (its pyproject.toml at v14.2.0), the ones that change outcomes
xfail_strict = true
addopts = --strict-markers
markers =
    slow
    multi_gpu
    parallel_threads
    iterations
    thread_unsafe
filterwarnings =
    always
    error::FutureWarning
    ignore:.* is experimental\.:FutureWarning:cupy
    ignore::UserWarning
    error::DeprecationWarning
    error::PendingDeprecationWarning
EOF
    echo "(no $suite_root/pyproject.toml: CuPy's pytest settings written to $ini)"
  fi
  selection=()
  eval "selection=($SELECTION)"
  xdist=1; has xdist || { xdist=""; echo "(pytest-xdist missing: one process per run)"; }
  guard=(); has pytest_timeout && guard=(--timeout "$TEST_TIMEOUT" --timeout-method thread) \
    || echo "(pytest-timeout missing: no per-test hang guard)"
  read -r -a runs <<< "$RUNS"
  remaining_weight=0
  for name in "${runs[@]}"; do remaining_weight=$((remaining_weight + 1)); done
  remaining_weight=$((remaining_weight + 1))  # the first run weighs two
  cupy_deadline=$((started + CUPY_SECONDS))
  first=1
  routed=(); tight=(); unrouted=""
  for name in "${runs[@]}"; do
    case $name in
      off)   mode=(--gpubudget-off); n=$WORKERS ;;
      root)  mode=(--gpubudget-mode root --gpubudget-limit "$LIMIT"); n=$WORKERS ;;
      child) mode=(--gpubudget-mode child --gpubudget-limit "$LIMIT" --gpubudget-root-limit "$LIMIT"); n=$WORKERS ;;
      tight) mode=(--gpubudget-mode root --gpubudget-limit "$TIGHT"); n=$TIGHT_WORKERS ;;
      *) echo "unknown run $name (tight, off, root, child)"; status=2; continue ;;
    esac
    weight=1; [ -n "$first" ] && weight=2
    now=$(date +%s)
    cap=$(( (cupy_deadline - now) * weight / remaining_weight ))
    remaining_weight=$((remaining_weight - weight)); first=""
    if [ "$cap" -lt 15 ]; then
      echo "== CuPy $name: not run, CUPY_SECONDS=$CUPY_SECONDS used up"; status=1; continue
    fi
    parallel=(); [ -n "$xdist" ] && [ "$n" -gt 0 ] && parallel=(-n "$n" --max-worker-restart 200)
    echo "== CuPy $name: ${mode[*]} ${parallel[*]} (stopped after ${cap} s)"
    t0=$(date +%s)
    (cd "$tests" && timeout -k 15 "$cap" python3 -m pytest -p scripts.suites.cupy_routed \
        -p no:cacheprovider -c "$ini" --rootdir "$suite_root" -q -rfE --tb=short \
        -o faulthandler_timeout=$((TEST_TIMEOUT * 2 / 3)) "${guard[@]}" "${parallel[@]}" \
        --gpubudget-label "$name" --gpubudget-outcomes "$work/cupy-$name.json" "${mode[@]}" \
        "${selection[@]}") > "$work/cupy-$name.log" 2>&1
    rc=$?
    t1=$(date +%s)
    last=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$work/cupy-$name.log" | tail -n 1)
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && last="STOPPED at ${cap} s (time share used up); $last"
    echo "   exit $rc after $((t1 - t0)) s: $last"
    grep -E "Timeout|crashed|node down|INTERNALERROR" "$work/cupy-$name.log" | head -n 20 | sed 's/^/   /'
    case $name in
      off) unrouted="$work/cupy-off.json" ;;
      tight) tight+=(--tight "$work/cupy-$name.json") ;;
      *) routed+=(--routed "$work/cupy-$name.json") ;;
    esac
  done
  if [ -n "$unrouted" ]; then
    echo "== CuPy: comparison"
    python3 scripts/suites/compare.py cupy --unrouted "$unrouted" "${routed[@]}" "${tight[@]}" \
      --md "$work/cupy.md" --json "$out/cupy-summary.json"
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    cupy_md="$work/cupy.md"
  else
    echo "== CuPy: no unrouted run to compare with (RUNS has no 'off')"
  fi
  (cd "$work" && tar -czf "$out/cupy-runs.tar.gz" cupy-* machine.txt 2>/dev/null)
fi

# -- PyTorch's OpInfo samples ------------------------------------------------------------------
opinfo_md=""
if [ -n "${SKIP_OPINFO:-}" ]; then
  echo "== OpInfo: skipped (SKIP_OPINFO)"
else
  echo "== OpInfo: (a) unrouted, (b) routed in $LIMIT, (c) in $TIGHT; dtypes $OPINFO_DTYPES; no new op after ${OPINFO_SECONDS} s"
  t0=$(date +%s)
  # shellcheck disable=SC2086 # OPINFO_ARGS is a list of words
  timeout -k 15 $((OPINFO_SECONDS + 45)) python3 scripts/suites/opinfo.py --out "$work/opinfo.json" \
    --md "$work/opinfo.md" --dtypes "$OPINFO_DTYPES" --max-seconds "$OPINFO_SECONDS" \
    --limit "$LIMIT" --root-limit "$LIMIT" --tight "$TIGHT" --op-timeout 60 $OPINFO_ARGS
  rc=$?
  echo "   opinfo.py exit $rc after $(($(date +%s) - t0)) s"
  if [ ! -f "$work/opinfo.json" ] && [ -f "$work/opinfo.jsonl" ]; then
    echo "   (it did not end: the table from what it streamed)"
    python3 scripts/suites/compare.py opinfo "$work/opinfo.jsonl" --md "$work/opinfo.md"
    cp "$work/opinfo.jsonl" "$out/opinfo.jsonl"
  fi
  [ "$rc" -ne 0 ] && status=1
  [ -f "$work/opinfo.json" ] && cp "$work/opinfo.json" "$out/opinfo.json"
  [ -f "$work/opinfo.md" ] && opinfo_md="$work/opinfo.md"
fi

# -- the summary ---------------------------------------------------------------------------------
{
  echo "## Other people's test suites, routed ($(date -u +%Y-%m-%d))"
  echo
  sed 's/^/    /' "$work/machine.txt"
  echo
  echo "CuPy tests: \`$CUPY_TESTS\`; selection: \`$SELECTION\`; runs: $RUNS; workers $WORKERS"
  echo "(tight: $TIGHT_WORKERS); budgets $LIMIT and $TIGHT; per-test timeout ${TEST_TIMEOUT} s."
  echo
  [ -n "$cupy_md" ] && cat "$cupy_md" && echo
  [ -n "$opinfo_md" ] && cat "$opinfo_md" && echo
  echo "Wall time of this script: $(($(date +%s) - started)) s."
} > "$out/summary.md"
echo "== summary: $out/summary.md"
cat "$out/summary.md"
echo "== exit $status after $(($(date +%s) - started)) s"
exec 1>&- 2>&-
wait "$tee_pid"  # the log is whole before the machine takes $OUT back
exit "$status"
