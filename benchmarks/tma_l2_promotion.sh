#!/usr/bin/env bash
# A probe for the GPU machine, not a setting of the package: how the TMA descriptors' L2 promotion (the granularity at
# which an L2 miss of a TMA copy is filled from DRAM) moves the sm_90 decode kernels. Triton's launcher encodes every
# host tensor descriptor with CU_TENSOR_MAP_L2_PROMOTION_L2_128B (in its driver.c); this copies the installed Triton
# to /tmp, rewrites that one constant to each promotion named, and times the cases under each copy with
# benchmarks/kernel_times.py (stage 1 and the call, a cache directory per promotion so that each compiles its own
# launcher). L2_128B is the unmodified launcher: run it in the same call as a baseline.
#   PROMOS="L2_128B L2_64B NONE L2_256B" bash benchmarks/tma_l2_promotion.sh "turboquant:k3v4_nc decode B=32 Hq=32 Hk=8 D=128 L="
# Measured (notebooks/results/perf_log.md, fiftieth session), k3v4 stage 1 at L=8K / 32K: on an H100 128B 131.7 /
# 615.0 us, 64B 134.2 / 549.6, none 134.0 / 556.1, 256B 140.7 / 707.7; on the H200 128B 94.4 / 329.3, 64B 105.2 /
# 380.2, 256B 102.2 / 426.6.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
src=$(python3 -c "import os, triton; print(os.path.dirname(triton.__file__))")
for promo in ${PROMOS:-L2_128B L2_64B}; do
  rm -rf /tmp/l2_promotion && mkdir -p /tmp/l2_promotion && cp -r "$src" /tmp/l2_promotion/triton
  launcher=/tmp/l2_promotion/triton/backends/nvidia/driver.c
  sed -i "s/CU_TENSOR_MAP_L2_PROMOTION_L2_128B/CU_TENSOR_MAP_L2_PROMOTION_$promo/g" "$launcher"
  echo "--- L2 promotion $promo ($(grep -c "CU_TENSOR_MAP_L2_PROMOTION_$promo" "$launcher") encode call(s) in the launcher)"
  TRITON_CACHE_DIR=/tmp/l2_promotion_cache_$promo PYTHONPATH=/tmp/l2_promotion:$PYTHONPATH \
    python3 benchmarks/kernel_times.py "$@" 2>&1 | grep -E "^\| |Error"
done
