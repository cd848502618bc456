#!/usr/bin/env bash
# Cross-compile (CPU, no GPU needed) every kernel a benchmarks/h200_session.sh call needs, and pack them as
# .gpu-cache/cpu.tar.xz (carry it with the call): every reference kernel for sm_90a, the fused configuration
# space for the benchmark and fused-test specializations, and the fused_phases variants.
#   bash benchmarks/h200_precompile.sh          (~7 min on 2 cores; the tarball is stale once templates change)
set -euo pipefail
cd "$(dirname "$0")/.."
root=.gpu-cache/cpu
rm -rf .gpu-cache
configs=()  # --config words of every non-reference configuration in kdajit.keys.FUSED_CONFIG_SPACE
while read -r word; do configs+=(--config "$word"); done < <(python -c '
import dataclasses
from kdajit.keys import FUSED_CONFIG_SPACE
for c in FUSED_CONFIG_SPACE[1:]:
    print(";".join(f"{k}={str(v).lower()}" for k, v in dataclasses.asdict(c).items()))')
precompile() { python -m kdajit precompile --cache-dir "$root" --arch sm_90a --no-progress "$@" | tail -1; }
python benchmarks/fused_phases.py --export .gpu-cache/phases
precompile                                                                            # every reference kernel
precompile --only fused_forward --beta bf16,fp32 --varlen dense --qg off "${configs[@]}"  # bench_forward rows
precompile --only fused_forward --beta fp32 --varlen dense --qg on "${configs[@]}"        # tests/test_gpu_fused.py
precompile --only fused_forward --beta bf16 --varlen cu64 --qg off "${configs[@]}"
precompile --only fused_forward --beta bf16 --varlen cu32 --qg on \
  --config "persistent=true;ctas_per_sm=2;raster=head;loads_ahead=0"
precompile --only fused_forward --beta bf16 --varlen dense --qg on "${configs[@]}"        # stressconfigs
tar -C .gpu-cache -cJf .gpu-cache/cpu.tar.xz cpu phases
ls -la .gpu-cache/cpu.tar.xz
