"""The benchmark: its cases are registered beside the parity cases, its SASS column counts MMA
instructions in a real sm_90 cubin, compiled on this CPU, and its FlashInfer peer rows are wired to
the cases' tensors and golden checks (with a fake flashinfer module: no peer kernel runs here)."""

from __future__ import annotations

import ast
import builtins
import csv
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tests.support import compiled_rows
from triton_impl.bench import (
    FLASHINFER,
    PeerMismatch,
    Result,
    _geomean,
    check_peer,
    flashinfer_peers,
    lse_from_base2,
    lse_to_base2,
    per_length_line,
    table_lines,
    time_peers,
    write_report,
)
from triton_impl.cli import main
from triton_impl.parity import registered_bench_cases

# Compiled (TRITON_INTERPRET=0) in a child process: here the kernels are interpreted. Triton
# compiles for a GPUTarget without a GPU, down to a cubin, with the ptxas in its wheel.
_COMPILE_AND_COUNT = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))


from triton_impl.bench import sass_mma_counts

signature = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "M": "constexpr", "N": "constexpr", "K": "constexpr"}
for rows in (64, 16):
    src = ASTSource(dot_kernel, signature, {(3,): rows, (4,): 64, (5,): 64})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": True})
    print(rows, *sass_mma_counts(kernel.asm["cubin"]))
"""


def test_sass_counts_tell_hgmma_from_hmma(tmp_path: Path) -> None:
    """A 64-row bf16 tl.dot with 4 warps is a Hopper warpgroup MMA (HGMMA); 16 rows fall back to HMMA."""
    script = tmp_path / "count_mma.py"  # a file: triton.jit reads the kernel's source
    script.write_text(_COMPILE_AND_COUNT)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=True
    ).stdout
    counts = {int(rows): (int(hgmma), int(hmma)) for rows, hgmma, hmma in (line.split() for line in out.splitlines())}
    assert counts[64][0] > 0 and counts[64][1] == 0, counts
    assert counts[16][0] == 0 and counts[16][1] > 0, counts


def test_bench_cases_are_registered_per_op() -> None:
    """Every op with a kernel worth timing has bench cases; sparse_indices keeps upstream's launch, untimed."""
    cases = registered_bench_cases()
    assert {c.op for c in cases} == {"decode_attention", "lse_merge", "mla_verify", "turboquant", "ue8m0_cache"}
    assert len({(c.op, c.name) for c in cases}) == len(cases), "two bench cases share a name"
    assert {c.op for c in registered_bench_cases(["lse_merge"])} == {"lse_merge"}
    with pytest.raises(ValueError, match="ops: unknown"):
        registered_bench_cases(["nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_to_time_the_interpreter(capsys) -> None:
    assert main(["bench", "--op", "lse_merge"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


# -- Peers (FlashInfer) ---------------------------------------------------------------------------
# On a CPU no peer kernel runs: these tests check the wiring, with a fake ``flashinfer`` module in
# sys.modules that implements the API surface the builders use, computed with torch in float64.


def _small_bench_cases() -> list:
    from triton_impl.parity import decode_attention, lse_merge, mla_verify

    return [c for m in (decode_attention, mla_verify, lse_merge) for c in m.bench_cases(small=True)]


def _has_peer(case) -> bool:
    """Every MLA decode and verify case, the GQA decode cases and the two-state merge; not the split merge."""
    return case.op != "lse_merge" or "merge_attn_states" in case.name


@pytest.fixture
def cpu_cases(monkeypatch):
    """Sets up the small bench cases on the CPU when called (after the test has chosen its flashinfer);
    their setup asks CUDA for the SM count. Only a CPU device gets the fake answer: on a GPU machine
    torch's own lazy CUDA initialization calls the real function."""
    real = torch.cuda.get_device_properties

    def device_properties(device=None):
        if isinstance(device, torch.device) and device.type == "cpu":
            return SimpleNamespace(multi_processor_count=132)
        return real(device)

    monkeypatch.setattr(torch.cuda, "get_device_properties", device_properties)
    return lambda: [(case, case.setup(torch.device("cpu"))) for case in _small_bench_cases()]


class _FakeFlashInfer:
    """Just enough of flashinfer 0.7 for the builders in triton_impl/bench.py. ``wrong`` breaks one
    output: ``"o"`` shifts the attention output, ``"lse_base_e"`` returns natural-log LSEs (FlashInfer's
    are base 2). ``calls`` counts kernel launches."""

    def __init__(self, wrong: str | None = None) -> None:
        self.wrong, self.calls = wrong, 0
        fake = self

        class MLAPlanMetadata:
            @classmethod
            def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
                meta = cls()
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_len_arr = (
                    qo_indptr, kv_indptr, kv_indices, kv_len_arr
                )  # fmt: skip
                return meta

        class BatchMLAPagedAttentionWrapper:
            def __init__(self, workspace: torch.Tensor, backend: str = "auto") -> None:
                assert workspace.dtype == torch.uint8 and backend == "fa3"

            def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                     q_data_type, kv_data_type, query_layout, kv_cache_layout, lse_mode, scale_mode):  # fmt: skip
                assert (query_layout, kv_cache_layout, lse_mode) == ("split", "split", "base2")
                fp8 = kv_data_type == torch.float8_e4m3fn
                assert scale_mode == ("kv-per-tensor" if fp8 else "default")
                for t in (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_len_arr):
                    assert t.dtype == torch.int32
                self.meta, self.causal, self.sm_scale = metadata, causal, sm_scale
                self.dtypes = (q_data_type, kv_data_type)
                self.widths, self.heads, self.page_size = (head_dim_ckv, head_dim_kpe), num_heads, page_size

            def run(self, *, query, kv_cache, out, lse, return_lse, ckv_scale=1.0, kpe_scale=1.0):
                fake.calls += 1
                (q_nope, q_pe), (ckv, kpe) = query, kv_cache
                assert return_lse and (q_nope.dtype, ckv.dtype) == self.dtypes and q_nope.shape[1] == self.heads
                assert (ckv.shape[-1], kpe.shape[-1]) == self.widths and ckv.shape[1] == self.page_size
                q = torch.cat([q_nope, q_pe], -1).double()
                keys_all = torch.cat([ckv.double() * ckv_scale, kpe.double() * kpe_scale], -1)
                m = self.meta
                for b in range(len(m.kv_len_arr)):
                    rows = slice(int(m.qo_indptr[b]), int(m.qo_indptr[b + 1]))
                    pages = m.kv_indices[int(m.kv_indptr[b]) : int(m.kv_indptr[b + 1])].long()
                    keys = keys_all[pages].flatten(0, 1)[: int(m.kv_len_arr[b])]
                    scores = torch.einsum("qhd,ld->qhl", q[rows], keys) * self.sm_scale
                    if self.causal:  # bottom-right aligned: token t of Q sees L - Q + 1 + t keys
                        tokens, length = scores.shape[0], keys.shape[0]
                        visible = torch.arange(length)[None, :] < (length - tokens + 1 + torch.arange(tokens))[:, None]
                        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
                    fake.write(out, lse, rows, scores, keys[:, : ckv.shape[-1]])
                return out, lse

        class BatchDecodeWithPagedKVCacheWrapper:
            def __init__(self, workspace: torch.Tensor, kv_layout: str, use_tensor_cores: bool) -> None:
                assert workspace.dtype == torch.uint8 and kv_layout == "NHD" and not use_tensor_cores

            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                     q_data_type, kv_data_type, sm_scale) -> None:  # fmt: skip
                for t in (indptr, indices, last_page_len):
                    assert t.dtype == torch.int32
                self.indptr, self.indices, self.last, self.page_size = indptr, indices, last_page_len, page_size
                self.heads, self.kv_heads, self.head_dim, self.sm_scale = num_qo_heads, num_kv_heads, head_dim, sm_scale

            def run(self, q, paged_kv_cache, *, out, lse, return_lse):
                fake.calls += 1
                k_cache, v_cache = paged_kv_cache
                assert return_lse and q.shape[1:] == (self.heads, self.head_dim) and k_cache.shape[1] == self.page_size
                group = self.heads // self.kv_heads
                for b in range(len(self.last)):
                    pages = self.indices[int(self.indptr[b]) : int(self.indptr[b + 1])].long()
                    length = (len(pages) - 1) * self.page_size + int(self.last[b])
                    k = k_cache[pages].flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)
                    v = v_cache[pages].flatten(0, 1)[:length].double().repeat_interleave(group, dim=1)
                    scores = torch.einsum("hd,lhd->hl", q[b].double(), k)[None] * self.sm_scale
                    fake.write(out, lse, slice(b, b + 1), scores, v.transpose(0, 1))
                return out, lse

        def merge_state(v_a, s_a, v_b, s_b):
            fake.calls += 1
            assert s_a.shape == v_a.shape[:2] and s_a.dtype == torch.float32 and s_a.is_contiguous()
            top = torch.maximum(s_a, s_b)
            w_a, w_b = torch.exp2(s_a - top), torch.exp2(s_b - top)
            merged = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
            merged_lse = top + torch.log2(w_a + w_b)
            if self.wrong == "o":
                merged = merged + 0.1
            if self.wrong == "lse_base_e":
                merged_lse = merged_lse * math.log(2.0)
            return merged.to(v_a.dtype), merged_lse

        self.module = ModuleType("flashinfer")
        self.module.mla = SimpleNamespace(
            BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper, MLAPlanMetadata=MLAPlanMetadata
        )
        self.module.decode = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper)
        self.module.merge_state = merge_state

    def write(self, out, lse, rows, scores, values) -> None:
        """Softmax of ``scores [rows, H, L]`` over ``values [L, D]`` (or ``[H, L, D]``) into ``out``; LSE base 2."""
        lse_e = torch.logsumexp(scores, -1)
        values = values.expand(scores.shape[1], *values.shape[-2:])
        o = torch.einsum("qhl,hld->qhd", torch.softmax(scores, -1), values)
        out[rows] = (o + (0.1 if self.wrong == "o" else 0.0)).to(out.dtype)
        lse[rows] = (lse_e if self.wrong == "lse_base_e" else lse_e / math.log(2.0)).float()


def _fixed_time(ms: float):
    def time_fn(fn) -> float:
        fn()
        return ms

    return time_fn


def _result(op: str, case: str, ms: float, **peers) -> Result:
    return Result(op, case, ms, 100.0, 1.0, "memory", ms / 2, 50.0, {"golden eager": 3 * ms}, "-", True, "", **peers)


def test_lse_base_conversion() -> None:
    """FlashInfer's LSE is log2 sum_j 2^(s_j log2 e) = ln(sum_j e^(s_j)) / ln 2: times ln 2 gives ours."""
    scores = torch.randn(6, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    natural = torch.logsumexp(scores, -1)
    base2 = torch.log2(torch.exp2(scores * math.log2(math.e)).sum(-1))
    torch.testing.assert_close(lse_from_base2(base2), natural, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_to_base2(natural), base2, rtol=0, atol=1e-12)
    assert (base2 - natural).abs().min() > 0.1  # negative control: a base-2 LSE read as natural is far off


def test_without_flashinfer_no_peer_runs_and_the_column_says_dash(monkeypatch, cpu_cases, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ModuleNotFoundError
    assert flashinfer_peers(lambda fi: pytest.fail("a peer was built without flashinfer")) == {}
    for case, bench in cpu_cases():
        assert bench.peers == {}, case.name
    assert time_peers({}) == ({}, {})
    table = _report(monkeypatch, tmp_path, [_result("mla_verify", "MLA verify", 0.2)])
    header, _, row = table[:3]
    assert header.endswith("| SASS | FlashInfer (ms, ours/peer speed) |")
    assert row.endswith("| - | - |"), row  # SASS "-", then no peer
    assert not any("Geomean ours/FlashInfer" in line for line in table)


def test_a_fake_flashinfer_fills_the_peer_column(monkeypatch, cpu_cases, tmp_path: Path) -> None:
    """With flashinfer importable, every MLA, GQA and two-state merge case builds a FlashInfer peer on its
    own tensors; checked against the golden model (base-2 LSE converted), then timed."""
    fake = _FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    results = []
    for case, bench in cpu_cases():
        if not _has_peer(case):
            assert bench.peers == {}, case.name
            continue
        assert set(bench.peers) == {FLASHINFER}, case.name
        calls = fake.calls
        ms, status = time_peers(bench.peers, time_fn=_fixed_time(0.3))
        assert status == {FLASHINFER: "ok"} and ms == {FLASHINFER: 0.3}, (case.name, status)
        assert fake.calls == calls + 2  # the checked run and the timed one
        results.append(_result(case.op, case.name, 0.15, peers_ms=ms, peers_status=status))
    assert {r.op for r in results} == {"decode_attention", "mla_verify", "lse_merge"}
    assert any("GQA" in r.case for r in results) and any("fp8" in r.case for r in results)
    table = _report(monkeypatch, tmp_path, results)
    assert all(line.endswith("| 0.3000 (2.00x) |") for line in table[2 : 2 + len(results)]), table
    assert "- mla_verify: 2.00x over 3 cases" in table
    saved = json.loads((tmp_path / "bench_h200.json").read_text())["results"][0]
    assert saved["peers_ms"] == {FLASHINFER: 0.3} and saved["peers_status"] == {FLASHINFER: "ok"}


@pytest.mark.parametrize("wrong", ["o", "lse_base_e"])
def test_a_peer_that_disagrees_with_golden_is_not_timed(monkeypatch, cpu_cases, tmp_path: Path, wrong: str) -> None:
    fake = _FakeFlashInfer(wrong)
    monkeypatch.setitem(sys.modules, "flashinfer", fake.module)
    output = "o" if wrong == "o" else "lse"
    for case, bench in cpu_cases():
        if not _has_peer(case):
            continue
        peer = bench.peers[FLASHINFER]()
        peer.run()
        with pytest.raises(PeerMismatch, match=f"FlashInfer {output} disagrees with the golden model: worst excess"):
            check_peer(FLASHINFER, peer)
        ms, status = time_peers(bench.peers, time_fn=lambda fn: pytest.fail("a wrong peer was timed"))
        assert math.isnan(ms[FLASHINFER]) and status[FLASHINFER].startswith(f"WRONG: FlashInfer {output} disagrees")
    result = _result("lse_merge", "merge", 0.1, peers_ms=ms, peers_status=status)
    row = _report(monkeypatch, tmp_path, [result])[2]
    assert row.endswith(" |") and f"| WRONG: FlashInfer {output} disagrees" in row


def test_a_broken_flashinfer_install_costs_only_its_cell(monkeypatch) -> None:
    real_import = builtins.__import__

    def fail_flashinfer(name, *args, **kwargs):
        if name == "flashinfer":
            raise OSError("libcudart.so.13: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fail_flashinfer)
    peers = flashinfer_peers(lambda fi: pytest.fail("built from a failed import"))
    ms, status = time_peers(peers, time_fn=lambda fn: pytest.fail("timed a failed import"))
    assert math.isnan(ms[FLASHINFER])
    assert status[FLASHINFER] == "failed: RuntimeError: import flashinfer failed: OSError: libcudart.so.13: " + (
        "cannot open shared object file"
    )


def test_report_keeps_its_columns_and_json_keys(monkeypatch, tmp_path: Path) -> None:
    """The columns and JSON keys notebooks read are unchanged; the peer column is appended."""
    wrong = Result("lse_merge", "bad", math.nan, 0, 0, "-", 0, 0, {}, "-", False, "o: worst excess 1")
    table = _report(monkeypatch, tmp_path, [_result("decode_attention", "MLA", 0.5), wrong])
    assert table[0].startswith(
        "| op | case | ms | GB/s | TFLOP/s | bound | roofline ms | % of roofline | baselines (ms) | SASS |"
    )
    assert all(line.count("|") == table[0].count("|") for line in table[:4]), table[:4]
    assert table[3] == "| lse_merge | bad | WRONG: not timed | | | | | | | o: worst excess 1 | - |"
    saved = json.loads((tmp_path / "bench_h200.json").read_text())["results"][0]
    old_keys = {"op", "case", "ms", "gbps", "tflops", "bound", "roofline_ms", "pct_roofline", "baselines_ms", "hgmma",
                "correct", "detail"}  # fmt: skip
    assert set(saved) == old_keys | {"peers_ms", "peers_status"}
    assert saved["baselines_ms"] == {"golden eager": 1.5}


def test_only_the_bench_runner_imports_flashinfer() -> None:
    """FlashInfer is a benchmark peer, never a dependency: one module imports it, inside functions only."""
    root = Path(__file__).resolve().parents[1]
    importers = {}
    for path in [*root.glob("golden/*.py"), *root.glob("triton_impl/**/*.py")]:
        tree = ast.parse(path.read_text())
        top_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "flashinfer" or n.startswith("flashinfer.") for n in names):
                assert id(node) not in top_level, f"{path.name} imports flashinfer at import time"
                importers[path.relative_to(root).as_posix()] = True
    assert set(importers) == {"triton_impl/bench.py"}


def _report(monkeypatch, tmp_path: Path, results: list[Result]) -> list[str]:
    """The table rows of ``write_report`` (header, rule, one row per result), then the rest of the file."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a CPU")
    monkeypatch.setenv("ATTNREF_COMMIT", "0000000")
    text = write_report(results, {"copy_gbps": 4000.0, "matmul_tflops": 700.0}, tmp_path).read_text()
    lines = text.splitlines()
    return lines[lines.index(next(line for line in lines if line.startswith("| op |"))) :]


def test_the_per_length_line_and_the_geomean_by_hand() -> None:
    """``per_length_line`` fits the lengths from ``from_length`` on, that length included (times 3, 5 at 2K, 4K: 1 us
    per 1K keys and 1 at L=0); ``_geomean`` drops what has no logarithm (0, inf, NaN)."""
    slope, intercept = per_length_line({1024: 9.0, 2048: 3.0, 4096: 5.0})
    assert slope == pytest.approx(1.0, abs=1e-12) and intercept == pytest.approx(1.0, abs=1e-12)
    assert _geomean([4.0, 1.0, math.inf, 0.0, math.nan]) == pytest.approx(2.0, abs=1e-12)
    assert math.isnan(_geomean([0.0, math.inf]))


def test_a_partial_run_merges_into_the_table(monkeypatch, capsys, tmp_path: Path) -> None:
    """``attnref bench-merge``: a run's rows replace those of the same (op, case) in place, new ones are appended,
    the rest and the notes above the table stay; the geomeans cover the merged rows and the JSON names each run's
    ceilings. Merging the same run twice changes nothing more."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a CPU")
    into, run = tmp_path / "results", tmp_path / "run"
    kept = [_result("mla_verify", "verify A", 0.4), _result("mla_verify", "verify B", 0.2),
            _result("lse_merge", "merge C", 0.1)]  # fmt: skip
    monkeypatch.setenv("ATTNREF_COMMIT", "aaaaaaa")
    write_report(kept, {"copy_gbps": 4000.0, "matmul_tflops": 700.0}, into)
    notes = into / "bench_h200.md"
    lines = notes.read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| op |")))
    prose = [*lines[:start], "Rows of verify B are from a run named here by hand.", ""]
    notes.write_text("\n".join([*prose, *lines[start:]]) + "\n")
    faster = Result("mla_verify", "verify B", 0.1, 200.0, 2.0, "memory", 0.05, 80.0, {}, "-", True)
    new_op = _result("decode_attention", "decode D", 0.3)
    monkeypatch.setenv("ATTNREF_COMMIT", "bbbbbbb")
    write_report([faster, new_op], {"copy_gbps": 4100.0, "matmul_tflops": 720.0}, run)

    assert main(["bench-merge", str(run), "--into", str(into)]) == 0
    merged = [kept[0], faster, kept[2], new_op]
    text = notes.read_text()
    assert text == "\n".join([*prose, *table_lines(merged)]) + "\n"
    assert "- mla_verify: 63.2%" in text  # sqrt(50 * 80): verify A's run and verify B's new one
    assert sum("| verify B |" in line for line in text.splitlines()) == 1
    saved = json.loads((into / "bench_h200.json").read_text())
    assert saved["results"] == [asdict(r) for r in merged]
    assert saved["ceilings"] == {"mla_verify, lse_merge (aaaaaaa)": {"copy_gbps": 4000.0, "matmul_tflops": 700.0},
                                 "mla_verify, decode_attention (bbbbbbb)": {"copy_gbps": 4100.0,
                                                                            "matmul_tflops": 720.0}}  # fmt: skip
    assert saved["header"] == next(line for line in prose if line.startswith("GPU: "))  # the table's, as it stands
    assert "commit aaaaaaa" in saved["header"]
    before = (text, (into / "bench_h200.json").read_text())
    assert main(["bench-merge", str(run), "--into", str(into)]) == 0
    assert (notes.read_text(), (into / "bench_h200.json").read_text()) == before
    assert main(["bench-merge", str(into), "--into", str(run)]) == 2  # a merged table is not a run
    assert capsys.readouterr().err.endswith("results/bench_h200.json is a merged table, not one bench run\n")


_TIMELINE_COMPILE = """
import json, sys
from pathlib import Path
from benchmarks import mla_timeline
from triton_impl.bench import sass_resources
kernels = mla_timeline.load_stamped(Path(sys.argv[1]))
for verify in (False, True):
    kernel = kernels.compile_for_sm90(verify=verify)
    print(json.dumps([verify, *sass_resources(kernel.asm["cubin"]), kernel.metadata.shared]))
"""


_TQ_TIMELINE_COMPILE = """
import json, sys
from pathlib import Path
from benchmarks import tq_timeline
from triton_impl import turboquant
from triton_impl.bench import sass_loop
kernels = tq_timeline.load_stamped(Path(sys.argv[1]))
for key_bits, value_bits in ((4, 4), (3, 3)):
    entry = turboquant.decode_entry(turboquant.DECODE_CONFIGS["sm90"], key_bits, value_bits)
    staging = turboquant.warp_stages(entry)
    kernel = kernels.compile_for_sm90(key_bits=key_bits, value_bits=value_bits, maxnreg=entry["WARP_MAXNREG"],
                                      stages=staging["STAGES"], step=staging["STEP"], fp16_operands=True, warp=True,
                                      stream_k=True)
    print(json.dumps([key_bits, len(sass_loop(kernel.asm["cubin"], "HMMA"))]))
"""


def test_the_mla_timeline_stamps_compile_for_hopper(tmp_path: Path) -> None:
    """``benchmarks/mla_timeline.py`` rebuilds the Gluon MLA stage 1 from its source with timer stamps: every edit
    still finds its place in the kernel (else it stops, naming the text), and both stamped entry kernels compile
    for sm_90, with the unstamped kernel's shared memory."""
    rows = compiled_rows(_TIMELINE_COMPILE, str(tmp_path))
    assert [row[0] for row in rows] == [False, True]
    assert all(224 * 1024 <= row[3] <= 232448 for row in rows), rows


def test_the_turboquant_timeline_stamps_compile_for_hopper(tmp_path: Path) -> None:
    """``benchmarks/tq_timeline.py`` rebuilds the TurboQuant stream-K stage 1 the same way: every edit finds its place,
    and the stamped kernel compiles for sm_90 with 4-bit and 3-bit keys and values, its chunk loop found (the stamps
    sit outside it)."""
    rows = compiled_rows(_TQ_TIMELINE_COMPILE, str(tmp_path))
    assert [row[0] for row in rows] == [4, 3] and all(row[1] > 500 for row in rows), rows


def test_the_turboquant_timeline_row_reads_the_stamps() -> None:
    """``benchmarks/tq_timeline.py``'s row from a trace (ns, 8 slots a program): an idle program (no pieces) counts in
    the span and the start spread but not in the phases, the end times are split by pieces a program, and the chunks
    by the program's rank on its warp scheduler (SM id + 65536 x warp slot: the scheduler is the slot modulo 4, the
    rank the slot divided by 4)."""
    from benchmarks import tq_timeline

    stamps = [  # start, ready, prologue, chunks, store, end, pieces, placement
        [1000, 3000, 2000, 90000, 1000, 97000, 1, 0],  # SM 0, warp slot 0: rank 0 on scheduler 0
        [1500, 4500, 4000, 88000, 2000, 99500, 2, 4 * 65536],  # SM 0, warp slot 4: rank 1 on scheduler 0
        [1200, 4000, 3000, 80000, 1000, 90000, 1, 1 * 65536],  # SM 0, warp slot 1: rank 0 on scheduler 1
        [2000, 0, 0, 0, 0, 2500, 0, 2 * 65536 + 5],  # idle: SM 5
    ]
    assert tq_timeline._cells(stamps) == ["4 (3)", "98.5", "1.0", "2.80, 3.00", "3.00, 4.00", "88.00, 90.00",
                                          "1.00, 2.00", "92.5, 96.0", "98.5, 98.5",
                                          "0: 2, 92.5, 96.0; 1: 1, 98.5, 98.5"]  # fmt: skip


def test_dram_bytes_reads_each_kernels_metrics_from_the_ncu_csv() -> None:
    """``benchmarks/dram_bytes.py`` parses ``ncu --csv --print-units base --metrics`` output: one entry per kernel
    (by its ID, in launch order, even where two launches share a name), every metric's value with thousands
    separators dropped, and the lines that are not CSV rows (the profiler's and the program's own) and the rows
    without a number skipped."""
    from benchmarks import dram_bytes

    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')  # fmt: skip

    def row(kernel_id: int, name: str, metric: str, unit: str, value: str) -> str:
        return (f'"{kernel_id}","4548","python3.12","127.0.0.1","{name}","1","7","(32, 1, 1)","(2112, 1, 1)","0",'
                f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')  # fmt: skip

    report = "\n".join([
        "==PROF== Connected to process 4548", "profiling turboquant: some case", header,
        row(0, "stage1", "dram__bytes_read.sum", "byte", "1,636,000,000"),
        row(0, "stage1", "gpu__time_duration.sum", "nsecond", "612,900"),
        row(1, "merge", "dram__bytes_read.sum", "byte", "2,500,000"),
        row(1, "merge", "a rule's row", "", ""),
        row(1, "merge", "a metric without data", "", "no data"),
        row(2, "stage1", "dram__bytes_read.sum", "byte", "7"),
        "==PROF== Disconnected from process 4548",
    ])  # fmt: skip
    assert dram_bytes.kernel_rows(report) == [
        ("stage1", {"dram__bytes_read.sum": 1.636e9, "gpu__time_duration.sum": 612900.0}),
        ("merge", {"dram__bytes_read.sum": 2.5e6}),
        ("stage1", {"dram__bytes_read.sum": 7.0}),
    ]


def test_ncu_stalls_names_the_load_a_long_scoreboard_wait_is_on() -> None:
    """``benchmarks/ncu_stalls.py``'s attribution of a long-scoreboard wait: the registers an instruction reads and
    writes (a 128-bit load's four, a 64-bit address's pair, a store's none), and the nearest load that last wrote a
    source register, found through the loop's back edge (a load of the iteration before) and not past a later
    writer."""
    from benchmarks import ncu_stalls

    assert ncu_stalls.writes("@!P1  LDG.E.EF.128 R20, desc[UR34][R34.64+0x10] ;") == {20, 21, 22, 23}
    assert ncu_stalls.reads("@!P1  LDG.E.EF.128 R20, desc[UR34][R34.64+0x10] ;") == {34, 35}
    assert ncu_stalls.writes("@P0 STG.E desc[UR4][R32.64+0x30], R45 ;") == set()
    assert ncu_stalls.reads("@P0 STG.E desc[UR4][R32.64+0x30], R45 ;") == {32, 33, 45}
    assert ncu_stalls.reads("PRMT R40, R20, 0x7610, R40 ;") == {20, 40}
    rows = [{"Source": source} for source in (
        "MOV R1, R2",  # 0: before the loop
        "IMAD.U32 R9, R5, 0x10000, RZ",  # 1 (loop head): R5 from row 4's load, the iteration before
        "LDG.E.64 R6, desc[UR4][R2.64]",  # 2
        "FADD R8, R7, R1",  # 3: R7 from row 2, 1 before
        "LDG.E.128 R4, desc[UR4][R2.64]",  # 4
        "MOV R7, R4",  # 5: R7 written again, by an ALU instruction
        "FADD R3, R7, R7",  # 6: its last writer is no load
        "@!P0 BRA 0x10",  # 7: the back edge
    )]  # fmt: skip
    assert ncu_stalls.waited_load(rows, 1, 1, 7) == (4, 4)
    assert ncu_stalls.waited_load(rows, 3, 1, 7) == (2, 1)
    assert ncu_stalls.waited_load(rows, 6, 1, 7) is None
    # Statically, without samples: each load's lead to its first reader, through the back edge (row 4's R4-R7 are
    # read by row 5, row 2's R6-R7 by row 3), the loop being rows 1-7
    assert ncu_stalls.load_leads([row["Source"] for row in rows[1:]]) == [(1, 1), (3, 1)]
    assert ncu_stalls.load_leads(["LDG.E R6, desc[UR4][R2.64]", "FADD R8, R9, R1", "IMAD R1, R6, R6, RZ",
                                  "@!P0 BRA 0x10"]) == [(0, 2)]  # fmt: skip
    assert ncu_stalls.load_leads(["IMAD R1, R6, R6, RZ", "LDG.E R6, desc[UR4][R2.64]", "@!P0 BRA 0x10"]) == [(1, 2)]


def test_ncu_stalls_sums_the_source_page_over_the_hottest_loop(tmp_path: Path, capsys) -> None:
    """``benchmarks/ncu_stalls.py`` on a small source page in Nsight Compute's CSV form: the innermost loop holding
    an MMA is found by its backward branch (not the wider loop around it), and samples are summed by reason (the
    "Not Issued" columns left out) over the kernel and over that loop."""
    from benchmarks import ncu_stalls

    reasons = ["stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *reasons]
    rows = [  # address, source, samples by the reasons above
        (0x00, "MOV R1, R2", (1, 0, 1)),
        (0x10, "HMMA.16816.F32 R4, R8, R12, R4", (5, 0, 5)),  # head of the outer loop
        (0x20, "LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", (3, 2, 3)),  # head of the inner loop
        (0x30, "HMMA.16816.F32 R4, R8, R12, R4", (7, 1, 7)),
        (0x40, "@!P0 BRA 0x20", (0, 4, 0)),  # the inner loop's back branch
        (0x50, "BRA 0x10", (0, 0, 0)),  # the outer loop's
        (0x60, "EXIT", (2, 0, 2)),
    ]
    path = tmp_path / "source.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "k", ""])
        writer.writerow(header)
        for address, source, samples in rows:
            writer.writerow([hex(address), f"      {source}", sum(samples[:2]), 10, *samples])
    kernel, loaded = ncu_stalls.load(str(path))
    assert kernel == "k" and len(loaded) == len(rows)
    assert ncu_stalls.hottest_loop(loaded) == (2, 4)
    assert ncu_stalls.reasons(loaded) == {"wait": 18, "barrier": 7}
    assert ncu_stalls.reasons(loaded[2:5]) == {"wait": 10, "barrier": 7}
    ncu_stalls.summarize(str(path))
    out = capsys.readouterr().out
    assert "loop: 3 instructions (rows 2-4), 17 of 25 samples" in out
    # With no MMA (the Hadamard store's butterflies): the loop with the most samples an instruction, the inner one
    no_mma = [{**r, "Source": r["Source"].replace("HMMA.16816.F32", "FADD")} for r in loaded]
    assert ncu_stalls.hottest_loop(no_mma) == (2, 4)
    assert ncu_stalls.hottest_loop([r for r in no_mma if "BRA" not in r["Source"]]) == (0, len(rows) - 3)


def test_the_suite_writes_each_test_phase_time_as_it_arrives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tests/conftest.py`` with ``ATTNREF_TEST_TIMES``: a tab-separated line a test phase (seconds, phase, outcome,
    test id), appended as each report arrives, so that a run a time limit cuts keeps its times; nothing from an xdist
    worker (its reports reach the controller, which writes them) and nothing without the variable."""
    from tests import conftest

    times = tmp_path / "times.tsv"
    report = SimpleNamespace(duration=1.23456, when="call", outcome="passed", nodeid="tests/test_bench.py::test_y[a b]")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv(conftest.TEST_TIMES_ENV, raising=False)
    conftest.pytest_runtest_logreport(report)
    assert not times.exists()
    monkeypatch.setenv(conftest.TEST_TIMES_ENV, str(times))
    conftest.pytest_runtest_logreport(report)
    conftest.pytest_runtest_logreport(SimpleNamespace(duration=0.5, when="teardown", outcome="passed",
                                                      nodeid=report.nodeid))  # fmt: skip
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_runtest_logreport(report)
    assert times.read_text().splitlines() == ["1.235\tcall\tpassed\ttests/test_bench.py::test_y[a b]",
                                              "0.500\tteardown\tpassed\ttests/test_bench.py::test_y[a b]"]  # fmt: skip
