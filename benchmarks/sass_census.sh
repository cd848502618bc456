#!/usr/bin/env bash
# Static SASS instruction mix of cached kernel objects (GPU machine: needs cuobjdump, not a GPU).
#   bash benchmarks/sass_census.sh CACHE_DIR [SLUG_PATTERN]
# For each kernel.o whose cache path matches SLUG_PATTERN (a grep -E pattern; default: the bf16 K = V = 128
# dense kernels and the inverse), prints the 16 most frequent opcodes (the part before the first dot) and the
# total. Static counts: loops are unrolled, so they approximate the instructions one CTA issues per tile,
# except that each warp runs only its own branch of warp-specialized code.
set -uo pipefail
root=$1
pattern=${2:-'(beta_dtype-bf16\.varlen-dense\.head_k-128\.head_v-128\.chunk-64(\.output_qg-false)?\.io_dtype-bf16|akk_inverse\.varlen-dense\.chunk-64\.io_dtype-bf16)/'}
find "$root" -name kernel.o | grep -E "$pattern" | sort | while read -r obj; do
  name=${obj#*/kernels/}
  cuobjdump --dump-sass "$obj" 2>/dev/null \
    | grep -oE '/\*[0-9a-f]+\*/ +(@!?U?P[0-9T] +)?[A-Z][A-Z0-9_.]+' | awk '{print $NF}' | cut -d. -f1 \
    | sort | uniq -c | sort -rn | awk -v n="${name%/kernel.o}" '
        {total += $1; if (NR <= 16) top = top sprintf(" %s %d", $2, $1)}
        END {printf "%s: total %d;%s\n", n, total, top}'
done
