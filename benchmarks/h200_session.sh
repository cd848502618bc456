#!/usr/bin/env bash
# GPU work on the project's lent H200 in one device call, as named stages:
#   bash benchmarks/h200_session.sh STAGE...        (carry .gpu, and .gpu-cache/cpu.tar.xz if present)
# Stages: tests (demo + the whole GPU suite), core (tests without the FLA-backend file and the FLA-ratio accuracy
# runs; CORE_LIMIT seconds, default 460: 406 s on an H100, 2026-12-07), core_fla (core and dslfree, the FLA tests in
# the background), flatests (the FLA-backend tests and the FLA-ratio coverage tests; FLA_K narrows them), suite (demo
# + the GPU suite but the fused and FLA-backend files, which have their own stages), fused (fused-kernel GPU tests),
# bench (bench_forward, every row, with --plot), benchmain (the two main rows, every fused configuration; BENCH_ROWS,
# BENCH_CONFIGS, BENCH_LIMIT), benchcov (the coverage rows, tile configurations), phases (fused_phases, objects from
# the tarball; PHASES_ONLY narrows them to "CONFIG.VARIANT CONFIG.VARIANT ..."; PHASES_SMS="132 96" times each on
# those numbers of SMs, by a green context: 96 of an H100's estimate an H200), held (held_sms.py: the copy rate on
# HELD_SMS numbers of SMs), anycard (issue 12's ranking on whichever card came: on an H200 phases and benchmain of the
# a1 schedules, on another card held and their phases on 132 and 96 SMs), pingpong (the probe configurations' bits
# against a1's, their GPU tests and phases), phasespad (the K = 60 / 64 / 100
# phase variants; PAD_K names one head size, PHASES_ONLY narrows them), compare (COMPARE_BASE's fused kernels against
# this tree's, bit for bit; benchmarks/compare_objects.py), extra (experiments' objects from other trees under
# .gpu-cache/extra/: phases and bit comparisons; EXTRA_EXPS names some of them, in order), repeat (main's K = 128
# phase variants and the experiments', in interleaved rounds: the spread beside each difference; EXTRA_EXPS,
# REPEAT_ROUNDS, REPEAT_ONLY), phasesany (fused_phases --gate any on each object directory under the tarball's pany/;
# PANY_DIRS, PANY_SCALES narrow it), dslfree (benchmarks/dsl_free_load.py), host (bench_host), tune (kdajit tune at
# the two tuning-evidence shapes), fla (FLA-backend GPU tests and bench), flabench (bench_fla_backend alone), stress
# (determinism replays), stressnoqg (replays without QG, forward's tile-w8 route), stressrest (stress but the bf16
# run), stress10m_fla (the 10M run beside the FLA-backend tests), stressconfigs (replays under other fused
# configurations), sanitizer (compute-sanitizer, docs/reliability.md; SANITIZER_TOOLS picks tools, SANITIZER_FILES and
# SANITIZER_K the tests), probe (racecheck of benchmarks/racecheck_probe.py, with and without named barriers), anygate
# (tests/test_gpu_any_gate.py but the FLA ratios), anygate_fla (those), fla_ratio (the FLA-ratio accuracy tests of
# forward, coverage and any gate: a numerics change's check; FLA_RATIO_K narrows them), benchany (bench_forward --gate
# any, main rows; BENCH_CONFIGS), ncu (Nsight Compute on one launch of the fused_phases variants NCU_VARIANTS, default
# tile-w8.all, of NCU_OBJECTS at head size NCU_KV, default the tarball's phases/ at 128, summarized by
# benchmarks/ncu_report.py; needs a machine whose runtime lets ncu read the counters: Firecracker, not gVisor). A
# stage named bg:STAGE runs beside the stages after it (its failure status is not kept; read its log); `wait` joins
# it.
# Each stage has its own time limit; logs and JSON go to $OUT (or ./out), and all of them into $OUT/00-outputs.tgz (a
# device call returns only 8 files). The bundle (.gpu) supplies CuTe DSL, TVM-FFI and FLA.
# `bash benchmarks/h200_precompile.sh` cross-compiles on the CPU machine every kernel the stages need into
# .gpu-cache/cpu.tar.xz, which saves the compiles here; its toolchain must match this checkout's templates.
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
source .gpu/activate.sh
python3 -m pip install -q --no-deps --no-build-isolation --root-user-action=ignore -e . >"$out/install.log" 2>&1 \
  || { cat "$out/install.log"; exit 1; }
export PYTHONUNBUFFERED=1 KDAJIT_CACHE_DIR=/tmp/kdajit-cache
rm -rf "$KDAJIT_CACHE_DIR"
if [[ -f .gpu-cache/cpu.tar.xz ]]; then
  mkdir -p /tmp/precompiled && tar -C /tmp/precompiled -xJf .gpu-cache/cpu.tar.xz
  cp -a /tmp/precompiled/cpu "$KDAJIT_CACHE_DIR"
  export KDAJIT_TEST_CPU_CACHE=/tmp/precompiled/cpu
  # A tarball precompiled from other templates (another branch's) holds no kernel of this checkout: say so loudly,
  # since every stage would then compile its kernels here and may run out of time.
  toolchain=$(python3 -c 'from kdajit import cache_toolchain as c; print("tc-" + c.toolchain_fingerprint())')
  if [[ -z "$toolchain" || ! -d /tmp/precompiled/cpu/v1/sm_90a/$toolchain ]]; then
    echo "WARNING: .gpu-cache/cpu.tar.xz has no kernels of this checkout's toolchain $toolchain (it has" \
      "$(ls /tmp/precompiled/cpu/v1/sm_90a 2>/dev/null | tr '\n' ' ')): every kernel compiles here" \
      | tee "$out/toolchain_mismatch.txt"
  fi
fi
# FLA's Triton kernels (the FLA stages) compile and autotune for minutes in this sandbox. Their autotuning
# results (*.autotune.json), saved by an earlier call ($OUT/triton.tar.xz, copied to .gpu-cache/triton.tar.xz
# and carried), skip the autotuning: each kernel then compiles only its chosen configuration. The whole cache
# (~250 MB of compiled kernels) is too large to carry, and packing it took minutes.
triton_cache="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
if [[ -f .gpu-cache/triton.tar.xz ]]; then
  mkdir -p "$triton_cache" && tar -C "$triton_cache" -xJf .gpu-cache/triton.tar.xz
fi
save_triton_cache() {
  (cd "$triton_cache" && find . -name '*.autotune.json' -print0 | tar --null -cJf "$out/triton.tar.xz" -T -)
  ls -la "$out/triton.tar.xz"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.mem --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null; git status --short -uno 2>/dev/null | head -5; } | tee "$out/gpu.txt"
status=0
pack_outputs() {  # every file of $out in one archive, 00-outputs.tgz: a device call returns at most 8 files of $OUT
  # (the first by name), so the logs of a call with many stages come back only this way. A temporary archive per
  # process, then a rename: a bg: stage packs beside the foreground ones.
  local part="$out/.outputs.$BASHPID.tgz"
  tar -czf "$part" -C "$out" --exclude=00-outputs.tgz --exclude='.outputs.*' . 2>/dev/null \
    && mv "$part" "$out/00-outputs.tgz"
  rm -f "$part"
}
stage() {  # stage NAME SECONDS CMD...: run CMD with a time limit, log to $out/NAME.log, keep the worst status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"; tail -n 25 "$out/$name.log"
  [[ $rc -eq 0 ]] || status=$rc
  pack_outputs  # after every stage: a call cut off at its time limit still returns the stages before
}
compare_sets() {  # compare_sets BASE_DIR OTHER_DIR PREFIX [REFERENCE]: compare_objects.py on every kvK-GATE set
  # (kvK-GATE-varlen: cu32 objects) of BASE_DIR (with REFERENCE, each OTHER object against BASE's REFERENCE.all.o)
  local set_dir name kv gate varlen
  for set_dir in "$1"/kv*/; do
    [[ -d "$set_dir" ]] || continue
    name=$(basename "$set_dir"); IFS=- read -r kv gate varlen <<<"${name#kv}"
    stage "$3_$name" 120 python3 benchmarks/compare_objects.py "$set_dir" "$2/$name" --kv "$kv" --gate "$gate" \
      ${varlen:+--varlen} ${4:+--reference "$4"}
  done
}
run_stage() {
  local what=$1
  case "$what" in
    tests)
      stage demo 120 python3 -m kdajit demo
      stage gpu_tests 420 python3 -m pytest -q -m gpu -rfE --durations=15 tests ;;
    core)  # the GPU suite but the FLA backend file and the four FLA-ratio accuracy runs (~160 s of FLA time)
      stage demo 120 python3 -m kdajit demo
      stage core "${CORE_LIMIT:-460}" python3 -m pytest -q -m gpu -rfE --durations=10 tests --ignore=tests/test_gpu_fla_backend.py \
        -k "not accuracy_within_contract_factor_of_fla" ;;
    fla_ratio)  # a numerics change's check: the FLA-ratio accuracy tests of forward, the coverage specializations and the
      # any-gate path (FLA_RATIO_K narrows them, default the dense cases; -s keeps their printed errors)
      stage fla_ratio "${FLA_LIMIT:-450}" python3 -m pytest -q -m gpu -rfE -s --durations=8 tests/test_gpu_forward.py \
        tests/test_gpu_coverage.py tests/test_gpu_any_gate.py \
        -k "accuracy_within_contract_factor_of_fla and (${FLA_RATIO_K:-dense})" ;;
    flatests)  # the FLA-backend tests and the coverage specializations' FLA-ratio tests (CPU-bound Triton compiles)
      stage fla_tests "${FLA_LIMIT:-450}" python3 -m pytest -q -m gpu -rfE --durations=8 \
        tests/test_gpu_fla_backend.py tests/test_gpu_coverage.py -k "${FLA_K:-fla}"
      save_triton_cache ;;
    core_fla)  # core and dslfree, with flatests beside them in the background; its kernels only perturb CTA
      # placement, which the bitwise tests must survive anyway
      run_stage flatests &
      run_stage core
      stage dslfree 90 python3 benchmarks/dsl_free_load.py --json "$out/dsl_free.json"
      wait ;;
    suite)
      stage demo 120 python3 -m kdajit demo
      stage suite 330 python3 -m pytest -q -m gpu -rfE --durations=15 tests --ignore=tests/test_gpu_fused.py \
        --ignore=tests/test_gpu_fla_backend.py ${SUITE_K:+-k "$SUITE_K"} ;;
    fused)
      stage fused 150 python3 -m pytest -q -m gpu -rfE --durations=8 tests/test_gpu_fused.py ;;
    bench)
      stage bench 330 python3 benchmarks/bench_forward.py --json "$out/bench.json" --plot "$out/bench.png" ;;
    benchmain)
      stage benchmain "${BENCH_LIMIT:-150}" python3 benchmarks/bench_forward.py --rows "${BENCH_ROWS:-main}" \
        --configs "${BENCH_CONFIGS:-all}" --json "$out/benchmain.json"
      save_triton_cache ;;  # FLA's autotuning results, for the next call's FLA timings
    benchcov)  # issue 9's coverage rows, with the tile configurations of 4 and 8 warps (precompiled)
      stage benchcov "${BENCH_LIMIT:-150}" python3 benchmarks/bench_forward.py --rows coverage --configs tile,tile-w8 \
        --json "$out/benchcov.json" ;;
    phases)
      stage phases 240 python3 benchmarks/fused_phases.py --objects /tmp/precompiled/phases ${PHASES_ONLY:+--only $PHASES_ONLY} \
        ${PHASES_SMS:+--sms $PHASES_SMS} --json "$out/phases.json" ;;
    held)  # the copy rate on fewer SMs (green contexts): the premise of PHASES_SMS's H200 estimate on an H100
      stage held 120 python3 benchmarks/held_sms.py ${HELD_SMS:-132 120 112 104 96 88 64} ;;
    anycard)  # issue 12's ranking on whichever card came: on an H200 the a1 schedules' phases and the main and
      # padded rows by `forward` (benchmain); on another card the same phases on all its SMs and on 96 (the H200
      # estimate), after the copy rate on fewer SMs (held)
      local a=persistent-c2-head-a1
      local only="$a.all $a.compute-only $a-ts.all $a-ts.compute-only $a-r1.all $a-r1.compute-only $a-r1-ts.all"
      only+=" $a-gv.all $a-gv.compute-only $a-ge.all tile.all"
      local p=persistent-c1-head-a1-w8  # two tiles per CTA (FusedConfig.pingpong; probes, see the pingpong stage)
      only+=" $p-pp.all $p-pp.compute-only $p-ppf.all $p-ppf.compute-only $p-ppi.all $p-ppi.compute-only"
      only+=" $p-gv-pp.all $p-gv-pp.compute-only"
      if [[ $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) == *H200* ]]; then
        PHASES_ONLY=${PHASES_ONLY:-$only} run_stage phases
        BENCH_LIMIT=${BENCH_LIMIT:-420} BENCH_ROWS=${BENCH_ROWS:-B2-T8192-H64-bf16,B2-T8192-H64-fp32,B2-T8192-H64-K60,B2-T8192-H64-K100} \
          BENCH_CONFIGS=${BENCH_CONFIGS:-$a,$a-ts,$a-gv,$a-ge,$a-r1,$a-r1-ts} run_stage benchmain
      else
        run_stage held
        PHASES_ONLY=${PHASES_ONLY:-$only} PHASES_SMS=${PHASES_SMS:-132 96} run_stage phases
      fi ;;
    pingpong)  # the probe configurations (keys.FUSED_PROBE_CONFIGS, FusedConfig.pingpong): their whole kernels
      # against a1's bits (h200_precompile.sh's pingpong/ sets), their GPU tests, their phases beside a1's
      compare_sets /tmp/precompiled/pingpong/base /tmp/precompiled/pingpong/head pingpong persistent-c2-head-a1
      stage pingpong_tests "${PINGPONG_LIMIT:-300}" python3 -m pytest -q -m gpu -rfE tests/test_gpu_fused.py \
        -k "w8 and pp"
      local a=persistent-c2-head-a1 p=persistent-c1-head-a1-w8
      PHASES_ONLY=${PHASES_ONLY:-"$a.all $a.compute-only $a.loads $a-gv.all $a-gv.compute-only $p-ppf.all \
$p-ppf.compute-only $p-pp.all $p-pp.compute-only $p-pp.loads $p-ppi.all $p-ppi.compute-only $p-gv-pp.all \
$p-gv-pp.compute-only"} run_stage phases ;;
    phasesany)  # the any-gate variants of every object directory under the tarball's pany/ (h200_precompile.sh
      # exports this tree's as pany/head; an experiment adds its own beside it)
      for dir in /tmp/precompiled/pany/*/; do
        name=$(basename "$dir")
        [[ -z "${PANY_DIRS:-}" || " $PANY_DIRS " == *" $name "* ]] || continue
        for scale in ${PANY_SCALES:-1 10}; do  # FLA's logsigmoid gates x 1 (every diagonal row fast) and x 10 (about half)
          stage "phasesany_${name}_x$scale" 120 python3 benchmarks/fused_phases.py --objects "$dir" --gate any \
            --gate-scale $scale --json "$out/phasesany_${name}_x$scale.json"
        done
      done ;;
    phasespad)  # the padded head sizes' phase variants from the tarball's pad/ (K = 60, 64: tile; K = 100: tile-w8; all
      # three: persistent-c2-head-a1); PAD_K names one head size (a glob), PHASES_ONLY narrows the variants as in phases
      for dir in /tmp/precompiled/pad/k${PAD_K:-*}/; do
        kv=$(basename "$dir"); kv=${kv#k}
        stage "phasespad_k$kv" 120 python3 benchmarks/fused_phases.py --objects "$dir" --kv "$kv" \
          ${PHASES_ONLY:+--only $PHASES_ONLY}
      done ;;
    compare)  # COMPARE_BASE's whole fused kernels against this tree's, bit for bit (h200_precompile.sh)
      compare_sets /tmp/precompiled/compare/base /tmp/precompiled/compare/head compare ;;
    extra)  # experiments' objects under the tarball's extra/EXP/ (exported from other trees with other_tree.py):
      # EXP/phases/ (safe gate, K = 128), EXP/phases-kvK/ (head size K) and EXP/phases-varlen/ (K = 128, cu32 kernels
      # on the packed row) timed with fused_phases,
      # EXP/compare/main/kvK-GATE[-varlen]/ against EXP/compare/EXP/ the same, bit for bit (compare_objects.py; if the file
      # EXP/compare/reference names a configuration, each EXP object against main's object of it). EXTRA_DIRS names the
      # phases directories to time (e.g. "phases phases-kv64"; default all); EXTRA_COMPARE=off skips the bit comparisons
      for exp in ${EXTRA_EXPS:-$(ls /tmp/precompiled/extra)}; do
        exp_dir=/tmp/precompiled/extra/$exp/
        [[ -d "$exp_dir" ]] || { echo "== extra: no $exp_dir in the tarball"; status=2; continue; }
        for phases_dir in "$exp_dir"phases*/; do
          [[ -d "$phases_dir" ]] || continue
          name=$(basename "$phases_dir"); kv=${name#phases}; kv=${kv#-kv}; varlen=
          [[ -z "${EXTRA_DIRS:-}" || " $EXTRA_DIRS " == *" $name "* ]] || continue
          [[ "$kv" == -varlen ]] && { kv=; varlen=--varlen; }
          stage "extra_${exp}_$name" 120 python3 benchmarks/fused_phases.py --objects "$phases_dir" --kv "${kv:-128}" \
            $varlen
        done
        [[ "${EXTRA_COMPARE:-on}" == on ]] && compare_sets "${exp_dir}compare/main" "${exp_dir}compare/$exp" \
          "extra_${exp}_compare" "$(cat "${exp_dir}compare/reference" 2>/dev/null)"
      done ;;
    repeat)  # main's K = 128 phase variants (the tarball's phases/) and each experiment's (extra/EXP/phases-kv128/, else
      # extra/EXP/phases/), timed in turn for REPEAT_ROUNDS rounds (default 3), every other round in reverse order:
      # a drift of the card shows in the spread, not as a difference. EXTRA_EXPS names the experiments, REPEAT_ONLY
      # narrows the variants (as PHASES_ONLY); the table (benchmarks/rounds_table.py): $out/repeat_table.log
      local names=() dirs=() exp dir round i
      for exp in main ${EXTRA_EXPS:-$(ls /tmp/precompiled/extra)}; do
        if [[ $exp == main ]]; then dir=/tmp/precompiled/phases/
        elif [[ -d /tmp/precompiled/extra/$exp/phases-kv128/ ]]; then dir=/tmp/precompiled/extra/$exp/phases-kv128/
        else dir=/tmp/precompiled/extra/$exp/phases/; fi
        [[ -d "$dir" ]] || { echo "== repeat: no K = 128 phases of $exp in the tarball"; status=2; continue; }
        names+=("$exp"); dirs+=("$dir")
      done
      for round in $(seq "${REPEAT_ROUNDS:-3}"); do
        for i in $(seq 0 $((${#names[@]} - 1))); do
          (( round % 2 )) || i=$((${#names[@]} - 1 - i))
          stage "repeat_${round}_${names[i]}" 90 python3 benchmarks/fused_phases.py --objects "${dirs[i]}" --kv 128 \
            ${REPEAT_ONLY:+--only $REPEAT_ONLY} --json "$out/repeat_${round}_${names[i]}.json"
        done
      done
      stage repeat_table 30 python3 benchmarks/rounds_table.py "$out"/repeat_*.json ;;
    dslfree)  # a cached fused kernel linked into a shared library and run through TVM-FFI alone (no DSL import)
      stage dslfree 90 python3 benchmarks/dsl_free_load.py --json "$out/dsl_free.json" ;;
    host)
      stage host 120 python3 benchmarks/bench_host.py --profile
      KDAJIT_LOADER=linked stage host_linked 120 python3 benchmarks/bench_host.py ;;
    tune)  # docs/tuning.md's evidence: every candidate's guard result and time, the winners
      stage tune 200 python3 -m kdajit tune --shape 2x8192x64 --shape 1x8192x32 --beta bf16 --no-progress
      stage tune_ls 30 python3 -m kdajit cache ls --spec fused ;;
    fla)
      stage fla_tests "${FLA_LIMIT:-540}" python3 -m pytest -q -m gpu -rfE --durations=8 tests/test_gpu_fla_backend.py
      stage fla_bench 180 python3 benchmarks/bench_fla_backend.py --json "$out/fla_bench.json"
      save_triton_cache ;;
    flabench)
      stage fla_bench "${FLABENCH_LIMIT:-240}" python3 benchmarks/bench_fla_backend.py --json "$out/fla_bench.json" \
        ${FLABENCH_ARGS:-}
      save_triton_cache ;;
    stress10m_fla)  # the 10M bf16 run alone to completion, with the FLA-backend tests (CPU-bound Triton
      # compiles, little GPU time) beside it in the background: their kernels only perturb CTA placement
      stage fla_tests "${FLA_LIMIT:-540}" python3 -m pytest -q -m gpu -rfE --durations=8 \
        tests/test_gpu_fla_backend.py &
      stage stress_bf16_10m 560 python3 benchmarks/stress_determinism.py --replays 10000000 --checkpoint 500000 \
        --beta bf16 --max-seconds 540 --report "$out/stress_bf16_10m.json"
      wait
      save_triton_cache ;;
    stressnoqg)  # replays of forward's route without QG (FLA's default; tile-w8 at K = 128), dense and varlen
      stage stress_noqg 80 python3 benchmarks/stress_determinism.py --replays 1000000 --checkpoint 250000 --beta bf16 \
        --no-qg --max-seconds 45 --report "$out/stress_noqg.json"
      stage stress_noqg_varlen 60 python3 benchmarks/stress_determinism.py --replays 1000000 --checkpoint 250000 \
        --varlen --no-qg --max-seconds 30 --report "$out/stress_noqg_varlen.json" ;;
    stressconfigs)  # replays under tuner configurations other than the reference (STRESS_CONFIGS, slugs)
      for config in ${STRESS_CONFIGS:-persistent-c2-head persistent-c1-chunk-a1}; do
        stage "stress_$config" 80 python3 benchmarks/stress_determinism.py --replays 1000000 --checkpoint 250000 \
          --beta bf16 --config "$config" --max-seconds 45 --report "$out/stress_$config.json"
      done
      stage stress_large_c2 80 python3 benchmarks/stress_determinism.py --replays 10000 --checkpoint 2500 \
        --batch 2 --tokens 8192 --heads 64 --config persistent-c2-chunk-a1 --max-seconds 60 \
        --report "$out/stress_large_c2.json" ;;
    stress|stressrest)  # each run stops at a checkpoint after --max-seconds; the report says whether it completed
      [[ $what == stress ]] && stage stress_bf16 280 python3 benchmarks/stress_determinism.py --replays 10000000 \
        --checkpoint 500000 --beta bf16 --max-seconds 250 --report "$out/stress_bf16.json"
      stage stress_varlen 80 python3 benchmarks/stress_determinism.py --replays 1000000 --checkpoint 250000 \
        --varlen --max-seconds 60 --report "$out/stress_varlen.json"
      stage stress_fp32 80 python3 benchmarks/stress_determinism.py --replays 1000000 --checkpoint 250000 \
        --beta fp32 --max-seconds 60 --report "$out/stress_fp32.json"
      stage stress_large 80 python3 benchmarks/stress_determinism.py --replays 10000 --checkpoint 2500 \
        --batch 2 --tokens 8192 --heads 64 --noise 0.25 --max-seconds 60 --report "$out/stress_large.json" ;;
    probe)  # is tile-w8's racecheck report the tool's? (docs/reliability.md)
      for named in on off; do
        stage "probe_named_$named" 120 compute-sanitizer --tool racecheck --error-exitcode 1 \
          python3 benchmarks/racecheck_probe.py --named "$named"
      done ;;
    anygate)
      stage anygate "${ANYGATE_LIMIT:-240}" python3 -m pytest -q -m gpu -rfE --durations=8 tests/test_gpu_any_gate.py \
        -k "not fla" ;;
    anygate_fla)  # FLA's token-parallel intra compiles and autotunes (CPU-bound Triton)
      stage anygate_fla "${FLA_LIMIT:-420}" python3 -m pytest -q -m gpu -rfE -s tests/test_gpu_any_gate.py -k fla
      save_triton_cache ;;
    benchany)
      stage benchany "${BENCH_LIMIT:-150}" python3 benchmarks/bench_forward.py --rows main --gate any \
        --configs "${BENCH_CONFIGS:-tile,tile-w8}" --json "$out/benchany.json"
      stage benchany_x10 "${BENCH_LIMIT:-150}" python3 benchmarks/bench_forward.py --rows main --gate any \
        --gate-scale 10 --json "$out/benchany_x10.json" ;;
    sanitizer)  # SANITIZER_TOOLS picks the tools (default all four); memcheck also runs the hostile cu_seqlens
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1
      for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
        [[ $tool == memcheck ]] && stage memcheck_hostile 150 compute-sanitizer --tool memcheck --error-exitcode 1 \
          python3 -m pytest -q -m gpu tests/test_gpu_hostile.py -k cu_seqlens
        stage "sanitizer_$tool" "${SANITIZER_LIMIT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 -m pytest -q -m gpu ${SANITIZER_FILES:-tests/test_gpu_forward.py tests/test_gpu_fused.py} \
          -k "${SANITIZER_K:-empty_sequences or random_varlen or forward_equals or standalone_varlen or c2-head-a1}"
      done
      unset PYTORCH_NO_CUDA_MEMORY_CACHING ;;
    ncu)  # to $out: the report (ncu.ncu-rep), its details page (ncu_details.log), the SASS table (ncu_sass.csv.gz)
      # and its summary (ncu_report.log)
      stage ncu "${NCU_LIMIT:-240}" ncu --profile-from-start off --clock-control none --set full -f -o "$out/ncu" \
        python3 benchmarks/fused_phases.py --objects "${NCU_OBJECTS:-/tmp/precompiled/phases}" --kv "${NCU_KV:-128}" \
        --only ${NCU_VARIANTS:-tile-w8.all} --profile
      stage ncu_details 120 ncu -i "$out/ncu.ncu-rep" --page details
      stage ncu_sass 120 bash -c "ncu -i '$out/ncu.ncu-rep' --page source --csv --print-source sass | gzip >'$out/ncu_sass.csv.gz'"
      stage ncu_report 60 python3 benchmarks/ncu_report.py "$out/ncu_sass.csv.gz" ;;
    *) echo "unknown stage $what"; status=2 ;;
  esac
}
for what in "$@"; do
  case "$what" in
    bg:*) run_stage "${what#bg:}" & ;;  # beside the stages that follow; `wait` joins it
    wait) wait ;;
    *) run_stage "$what" ;;
  esac
done
wait
pack_outputs
exit $status
