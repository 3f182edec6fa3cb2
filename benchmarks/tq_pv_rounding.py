"""TurboQuant decode with ``p * scale`` rounded once to fp16 in the value MMA against the hi + lo split (timing only).

``PYTHONPATH=. python3 benchmarks/tq_pv_rounding.py`` on the GPU: the 4-bit and k8v4 bench cases, each config
timed twice, alternating. The one-rounding variant (``PV_HI_LO`` 0) fails the ``turboquant`` tolerance rows as they
stand (``test_decode_matches_golden_on_the_same_bytes``), so it is not a config entry; results in perf_log.md.
"""
import os

os.environ["ATTNREF_CHECK_CONTENTS"] = "0"
import torch
import triton.testing

from triton_impl import turboquant
from triton_impl.launch import forget_plans
from triton_impl.parity import registered_bench_cases

entry = dict(turboquant.DECODE_CONFIGS["sm90"])
for case in registered_bench_cases(["turboquant"]):
    if "decode" not in case.name or not any(p in case.name for p in ("4bit", "k8v4")):
        continue
    bench = case.setup(torch.device("cuda"))
    times = []
    for pv in (1, 0, 1, 0):
        turboquant.DECODE_CONFIGS["sm90"] = {**entry, "PV_HI_LO": pv}
        forget_plans()
        bench.run()
        torch.cuda.synchronize()
        times.append(triton.testing.do_bench(bench.run, warmup=25, rep=100, return_mode="median"))
    print(f"{case.name}: hi+lo {times[0]:.4f} / {times[2]:.4f} ms, one rounding {times[1]:.4f} / {times[3]:.4f} ms",
          flush=True)
    del bench
    torch.cuda.empty_cache()
