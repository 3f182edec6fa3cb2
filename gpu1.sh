#!/usr/bin/env bash
# Session 35, call 6: the one-warp decode rotating its query with 3-bit values (the test now drops HADAMARD_QUERY_v3).
export PYTHONPATH=. TRITON_CACHE_DIR=/tmp/triton_cache HYPOTHESIS_PROFILE=gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_turboquant.py -k "each_gluon_kernel and 3bit_nc" 2>&1 | tail -5
