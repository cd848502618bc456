#!/usr/bin/env bash
# One GPU session on the project's lent H200, in one device call:
#   bash benchmarks/h200_session.sh [tests|bench|all]    (carry .gpu and .gpu-cache)
# Logs and JSON go to $OUT (or ./out). The bundle (.gpu) supplies CuTe DSL, TVM-FFI and FLA.
set -uo pipefail
what="${1:-all}"
out="${OUT:-out}"; mkdir -p "$out"
source .gpu/activate.sh
python3 -m pip install -q --no-deps --no-build-isolation --root-user-action=ignore -e . >"$out/install.log" 2>&1 \
  || { cat "$out/install.log"; exit 1; }
export PYTHONUNBUFFERED=1 KDAJIT_CACHE_DIR=/tmp/kdajit-cache
# A cache precompiled on the CPU machine (kdajit precompile --cache-dir .gpu-cache/cpu) saves the compiles.
if [[ -d .gpu-cache/cpu ]]; then rm -rf "$KDAJIT_CACHE_DIR"; cp -a .gpu-cache/cpu "$KDAJIT_CACHE_DIR"; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$out/gpu.txt"
status=0
if [[ "$what" == tests || "$what" == all ]]; then
  python3 -m kdajit demo 2>&1 | tee "$out/demo.log"; status=$((status | PIPESTATUS[0]))
  if [[ -d .gpu-cache/cpu ]]; then export KDAJIT_TEST_CPU_CACHE="$PWD/.gpu-cache/cpu"; fi
  python3 -m pytest -q -m gpu -rA --durations=12 tests 2>&1 | tee "$out/gpu_tests.log" | grep -vE "^(PASSED|SKIPPED) " | tail -80
  status=$((status | PIPESTATUS[0]))
fi
if [[ "$what" == bench || "$what" == all ]]; then
  python3 benchmarks/bench_forward.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
  status=$((status | PIPESTATUS[0]))
fi
exit $status
