#!/usr/bin/env bash
# Cross-compile (CPU, no GPU needed) every kernel a benchmarks/h200_session.sh call needs, and pack them as
# .gpu-cache/cpu.tar.xz (carry it with the call): every reference kernel of bf16 K = V = 128 for sm_90a, the
# coverage tests' fp16, K = V = 64 / 256, K != V and chunk-32 kernels, the fused configuration space for the benchmark and
# fused-test specializations, and the fused_phases variants.
#   bash benchmarks/h200_precompile.sh          (~17 min on 2 cores; the tarball is stale once templates change)
#   COMPARE_BASE=<commit> bash benchmarks/h200_precompile.sh   (also that commit's kernels, for the compare stage)
#   EXTRA_TREES="NAME=COMMIT[@BASE] ..." bash benchmarks/h200_precompile.sh   (experiments' objects: the extra stage)
set -euo pipefail
cd "$(dirname "$0")/.."
root=.gpu-cache/cpu
# keeps triton.tar.xz (h200_session.sh)
rm -rf "$root" .gpu-cache/phases .gpu-cache/pany/head .gpu-cache/pad .gpu-cache/compare .gpu-cache/cpu.tar.xz
config_words() {  # --config words of every non-reference configuration the tuner builds with QG $1 (on|off)
  python -c '
import dataclasses, sys
from kdajit import tuner
from kdajit.keys import ForwardSpec
spec = ForwardSpec("bf16", "dense", 128, 128, 64, sys.argv[1] == "on", "sm_90a")
for c in tuner.candidates(spec)[0][1:]:
    print("--config", ";".join(f"{k}={str(v).lower()}" for k, v in dataclasses.asdict(c).items()))' "$1"
}
configs=(); while read -r flag word; do configs+=("$flag" "$word"); done < <(config_words off)
qg_configs=(); while read -r flag word; do qg_configs+=("$flag" "$word"); done < <(config_words on)
precompile_chunk() {  # precompile_chunk CHUNK ARGS...
  local chunk=$1; shift
  python -m kdajit precompile --cache-dir "$root" --arch sm_90a --no-progress --chunk "$chunk" "$@" | tail -1
}
precompile() { precompile_chunk 64 "$@"; }
fused_bf16_128() { precompile --only fused_forward --io bf16 --kv 128 "$@"; }  # the fused configuration space
cov() { precompile --gate safe "$@"; }  # the safe-gate coverage kernels (the any-gate ones are listed below)
python benchmarks/fused_phases.py --export .gpu-cache/phases
python benchmarks/fused_phases.py --export .gpu-cache/pany/head --gate any --only tile-w8.all tile-w8.loads+intra \
  tile-w8.compute-only tile.all
# the padded head sizes' phase variants (h200_session.sh phasespad): K = 60 and 64 in the 4-warp tile, K = 100 in
# tile-w8 (forward's configurations there until 0959a4a), and all three in persistent-c2-head-a1 (since then), beside
# its gate_rows="early-vbuf" form (a1-gv: whole and computing alone)
variant_words() { printf "$1.%s " "${@:2}"; }  # variant_words CONFIG VARIANT...: fused_phases --only words
# W and U by TMA stores (FusedConfig.stores, a probe config of fused_phases): beside a1 and a1-r1 in the repeat stage
python benchmarks/fused_phases.py --export .gpu-cache/phases --only \
  $(variant_words persistent-c2-head-a1-ts all compute-only) $(variant_words persistent-c2-head-a1-r1-ts all compute-only)
phase_variants() { variant_words "$1" loads loads+intra loads+intra+inverse all compute-only; }
a1=persistent-c2-head-a1
gv=$(variant_words $a1-gv all compute-only)
python benchmarks/fused_phases.py --export .gpu-cache/pad/k60 --kv 60 --only $(phase_variants tile) \
  $(phase_variants $a1) $gv
python benchmarks/fused_phases.py --export .gpu-cache/pad/k64 --kv 64 --only $(phase_variants tile) \
  $(phase_variants $a1) $gv
python benchmarks/fused_phases.py --export .gpu-cache/pad/k100 --kv 100 --only $(phase_variants tile-w8) \
  $(phase_variants $a1) $gv
# the configurations outside the space (keys.FUSED_PROBE_CONFIGS: two tiles per CTA, FusedConfig.pingpong) for
# h200_session.sh pingpong: their phase variants beside a1's (phases/, pad/k100), their whole kernels against a1's
# bits (pingpong/head against pingpong/base's a1, dense and cu32 at K = 128, K = 100), and their GPU tests' kernels
pp=persistent-c1-head-a1-w8
python benchmarks/fused_phases.py --export .gpu-cache/phases --only $(variant_words $pp-pp all compute-only loads) \
  $(variant_words $pp-ppf all compute-only) $(variant_words $pp-ppi all compute-only) \
  $(variant_words $pp-gv-pp all compute-only)
python benchmarks/fused_phases.py --export .gpu-cache/pad/k100 --kv 100 --only $(variant_words $pp-pp all) \
  $(variant_words $pp-gv-pp all)
rm -rf .gpu-cache/pingpong
for set in 128-safe 128-safe-varlen 100-safe; do
  varlen=$([[ "$set" == *-varlen ]] && echo --varlen || true)
  python benchmarks/fused_phases.py --export ".gpu-cache/pingpong/base/kv$set" --kv "${set%%-*}" $varlen \
    --only persistent-c2-head-a1.all
  python benchmarks/fused_phases.py --export ".gpu-cache/pingpong/head/kv$set" --kv "${set%%-*}" $varlen \
    --only $(variant_words "$pp-pp" all) $(variant_words "$pp-ppf" all) $(variant_words "$pp-ppi" all) \
    $(variant_words "$pp-gv-pp" all)
done
# COMPARE_BASE=<commit>: that commit's whole fused kernels beside this tree's (h200_session.sh compare), for a change
# meant to keep the bits whose PTX differs; COMPARE_SETS lists the sets K-GATE (both 4- and 8-warp tiles each)
# Other commits' trees (COMPARE_BASE, EXTRA_TREES): `checkout_tree REV` sets $tree to a worktree of REV, removed when
# the script exits, also when an export fails; `tree_export TREE DIR ARGS...` is fused_phases --export DIR ARGS with
# TREE's kdajit (other_tree.py).
trees=()
trap 'for t in "${trees[@]}"; do git worktree remove --force "$t"; done' EXIT
checkout_tree() { tree=$(mktemp -d); git worktree add -f --detach "$tree" "$1" >/dev/null; trees+=("$tree"); }
tree_export() { python benchmarks/other_tree.py "$1" benchmarks/fused_phases.py --export "$2" "${@:3}"; }
if [[ -n "${COMPARE_BASE:-}" ]]; then
  checkout_tree "$COMPARE_BASE"
  for kv_gate in ${COMPARE_SETS:-128-safe 128-any 100-safe 100-any 60-safe}; do
    for side_path in "base $tree" "head ."; do
      read -r side path <<< "$side_path"
      tree_export "$path" ".gpu-cache/compare/$side/kv$kv_gate" --kv "${kv_gate%-*}" --gate "${kv_gate#*-}" \
        --only tile.all tile-w8.all
    done
  done
fi
# EXTRA_TREES="NAME=COMMIT[@BASE] ...": experiments from their own commits, for h200_session.sh extra (replacing
# .gpu-cache/extra/NAME): the persistent a1 and a1-ge kernels' all and compute-only variants at K = V = 128, 64, 60 and
# 100 (extra/NAME/phases-kvK) and, with @BASE (a commit whose bits NAME must keep), the whole a1, a1-ge and tile
# kernels of both at K = 128 (dense and cu32), 64 and 100 (extra/NAME/compare/{main,NAME}: main is BASE's side)
for entry in ${EXTRA_TREES:-}; do
  name=${entry%%=*} rest=${entry#*=}
  commit=${rest%%@*} base=
  [[ "$rest" == *@* ]] && base=${rest#*@}
  rm -rf ".gpu-cache/extra/$name"
  for side in "$name $commit" ${base:+"main $base"}; do
    read -r label rev <<< "$side"
    checkout_tree "$rev"
    if [[ "$label" == "$name" ]]; then
      for kv in 128 64 60 100; do
        tree_export "$tree" ".gpu-cache/extra/$name/phases-kv$kv" --kv "$kv" \
          --only $(variant_words $a1 all compute-only) $(variant_words $a1-ge all compute-only)
      done
    fi
    if [[ -n "$base" ]]; then
      for set in 128-safe 128-safe-varlen 64-safe 100-safe; do
        tree_export "$tree" ".gpu-cache/extra/$name/compare/$label/kv$set" --kv "${set%%-*}" \
          $([[ "$set" == *-varlen ]] && echo --varlen) \
          --only tile.all $(variant_words $a1 all) $(variant_words $a1-ge all)
      done
    fi
  done
done
precompile --io bf16 --kv 128                      # every reference kernel of bf16 K = V = 128, both gate paths
# tests/test_gpu_coverage.py: fp16 and K = V = 64, 256 with beta in the io dtype, dense and cu32; QG on with the
# reference and a persistent configuration, QG off with the reference and tile-w8 (also the coverage bench rows)
persistent_c1="persistent=true;ctas_per_sm=1;raster=head;loads_ahead=1"
tile_w8="persistent=false;ctas_per_sm=2;raster=chunk;loads_ahead=0;warps=8"
cov --io fp16 --beta fp16 --kv 64,128,256 --varlen dense,cu32 --qg on --config ref --config "$persistent_c1"
cov --io bf16 --beta bf16 --kv 64,256 --varlen dense,cu32 --qg on --config ref --config "$persistent_c1"
cov --io fp16 --beta fp16 --kv 64,128,256 --varlen dense,cu32 --qg off --config ref --config "$tile_w8"
cov --io bf16 --beta bf16 --kv 64,256 --varlen dense,cu32 --qg off --config ref --config "$tile_w8"
# ... and its K != V cases, the same configurations
for qg_config in "on --config $persistent_c1" "off --config $tile_w8"; do
  read -r qg flag config <<< "$qg_config"
  cov --io bf16 --beta bf16 --kv 64x128,128x64,64x256 --varlen dense,cu32 --qg "$qg" --config ref "$flag" "$config"
  cov --io fp16 --beta fp16 --kv 256x64 --varlen dense,cu32 --qg "$qg" --config ref "$flag" "$config"
  # its chunk-32 cases on both gate paths (the bench's C32 row is the bf16 K = 128 dense one without QG)
  precompile_chunk 32 --io bf16 --beta bf16 --kv 128,256x128 --varlen dense,cu32 --qg "$qg" --config ref "$flag" \
    "$config"
  precompile_chunk 32 --io fp16 --beta fp16 --kv 64 --varlen dense,cu32 --qg "$qg" --config ref "$flag" "$config"
done
# forward's untuned configuration where K = V pads to 64 or 128 without QG (kdajit/untuned_configs.py; precompile
# without --config builds it beside the reference), for the forward calls of the coverage, grouped-head, any-gate and
# FLA-backend tests and of the bench rows: K = V = 128 both gates, 64 / 60 / 100 safe, 100 any (FLA's D = 100 shapes)
precompile --only fused_forward --io bf16 --beta bf16,fp32 --kv 128 --varlen dense,cu32,cu64 --qg off
precompile --only fused_forward --io fp16 --beta fp16 --kv 128 --varlen dense,cu32,cu64 --qg off
cov --only fused_forward --io bf16 --beta bf16 --kv 64,60,100 --varlen dense,cu32 --qg off
cov --only fused_forward --io fp16 --beta fp16 --kv 64,100 --varlen dense,cu32 --qg off
precompile --only fused_forward --gate any --io bf16 --beta bf16 --kv 100 --varlen dense,cu64 --qg off
# ... and the other a1 forms of the same K = V = 128 calls (a1-ge; a1-gv, Kp in Vp's tile; a1-r1, the mainloop one
# head-dim step per iteration, the untuned one in the twenty-third session) and K = V = 60 calls (plain a1, the
# untuned one until the twenty-fourth session): the untuned configuration there if an H200 ranks it first
# (untuned_configs; outside the toolchain fingerprint, so a flip needs no new tarball). K = V = 64's a1-ge is its
# untuned configuration, built above.
persistent_c2_a1="persistent=true;ctas_per_sm=2;raster=head;loads_ahead=1"
for config in "$persistent_c2_a1;gate_rows=early" "$persistent_c2_a1;gate_rows=early-vbuf" \
    "$persistent_c2_a1;intra_unroll=1"; do
  precompile --only fused_forward --io bf16 --beta bf16,fp32 --kv 128 --varlen dense,cu32,cu64 --qg off \
    --config "$config"
  precompile --only fused_forward --io fp16 --beta fp16 --kv 128 --varlen dense,cu32,cu64 --qg off --config "$config"
done
cov --only fused_forward --io bf16 --beta bf16 --kv 60 --varlen dense,cu32 --qg off --config "$persistent_c2_a1"
# tests/test_gpu_coverage.py's padded head sizes (K = 60, 100; K != V: 100 x 60, 100 x 128, 64 x 60, 4 x 252,
# 252 x 4), the configurations of its other cases
for qg_config in "on --config $persistent_c1" "off --config $tile_w8"; do
  read -r qg flag config <<< "$qg_config"
  cov --io bf16 --beta bf16 --kv 60,100x60,100,100x128,64x60,4x252,252x4 --varlen dense,cu32 --qg "$qg" --config ref \
    "$flag" "$config"
  cov --io fp16 --beta fp16 --kv 100 --varlen dense,cu32 --qg "$qg" --config ref "$flag" "$config"
done
# tests/test_gpu_fla_backend.py's FLA shapes with D = 60 (safe gate) and 100 (any gate), dense and cu64
precompile --gate safe --io bf16 --beta bf16 --kv 60 --varlen dense --qg on --config ref
precompile --gate safe --io bf16 --beta bf16 --kv 60 --varlen dense --qg off --config ref --config "$tile_w8"
precompile --gate any --io bf16 --beta bf16 --kv 100 --varlen dense,cu64 --qg on --config ref
precompile --gate any --io bf16 --beta bf16 --kv 100 --varlen dense,cu64 --qg off --config ref --config "$tile_w8"
fused_bf16_128 --gate safe --beta bf16,fp32 --varlen dense --qg off "${configs[@]}"  # bench_forward rows
cov --io bf16 --beta bf16 --kv 256 --varlen dense --qg off \
  --config "persistent=true;ctas_per_sm=1;raster=head;loads_ahead=0;warps=8"  # the K = 256 row's 8-warp persistent
fused_bf16_128 --gate safe --beta fp32 --varlen dense --qg on "${qg_configs[@]}"     # tests/test_gpu_fused.py
fused_bf16_128 --gate safe --beta bf16 --varlen cu64 --qg off "${configs[@]}"
fused_bf16_128 --gate safe --beta bf16 --varlen cu32 --qg on \
  --config "persistent=true;ctas_per_sm=2;raster=head;loads_ahead=0"
fused_bf16_128 --gate safe --beta bf16 --varlen dense --qg on "${qg_configs[@]}"     # stressconfigs
# tests/test_gpu_fused.py's probe configurations (its many-tile and long-walk tests)
pingpong="$persistent_c1;warps=8"
for mode in "pingpong=free" "pingpong=intra" "pingpong=inverse" "gate_rows=early-vbuf;pingpong=intra"; do
  fused_bf16_128 --gate safe --beta fp32,bf16 --varlen dense --qg off --config "$pingpong;$mode"
  fused_bf16_128 --gate safe --beta bf16 --varlen cu64 --qg off --config "$pingpong;$mode"
  [[ "$mode" == gate_rows=* ]] || fused_bf16_128 --gate safe --beta fp32 --varlen dense --qg on --config "$pingpong;$mode"
done
# tests/test_gpu_any_gate.py (every configuration, QG on and off; the coverage cases) and bench_forward --gate any
fused_bf16_128 --gate any --beta fp32 --varlen dense,cu64 --qg off "${configs[@]}"
fused_bf16_128 --gate any --beta fp32 --varlen dense,cu64 --qg on "${qg_configs[@]}"
precompile --gate any --io fp16 --beta fp16 --kv 64 --varlen cu64 --qg on --config ref
precompile --gate any --io bf16 --beta bf16 --kv 256 --varlen cu64 --qg on --config ref
# .gpu-cache/extra/EXP/ (kept between runs): an experiment's objects exported from its own tree (h200_session.sh extra)
tar -C .gpu-cache -cJf .gpu-cache/cpu.tar.xz cpu phases pany pad pingpong $(cd .gpu-cache && ls -d compare extra 2>/dev/null)
ls -la .gpu-cache/cpu.tar.xz
