"""The wrappers' per-call plans: a call layout is checked once, and every check still fires.

``decode_attention_fwd``, ``decode_attention_fwd_verify``, ``merge_attn_states``, ``merge_splits`` and
``triton_turboquant_decode_attention_v2`` key a plan on every tensor's type, dtype, shape, strides,
device and 16-byte alignment and on every other argument (with its type where a check reads the
type); a call with a known key skips the metadata checks. Here each check fires on a call that
differs from an already planned one in that one fact, the content checks run on every call, layouts
called in turn keep their own plans, plans hold no caller tensor, TurboQuant's centroids are read
anew on every call, and the CPU benchmark of the host path
(``benchmarks/host_overhead_cpu.py``) runs every serving case through the cached launch path.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import assert_bits_equal, generator, paged_cache, randn
from triton_impl import decode_attention as dec
from triton_impl import decode_attention_sm90, launch, lse_merge, mla_verify
from triton_impl import turboquant as ttq
from triton_impl.launch import DescriptorsByAddress, Plans, forget_plans
from triton_impl.validation import CONTENT_CHECKS_ENV

ROOT = Path(__file__).resolve().parent.parent
PAGE = 4


def _decode_args(device: torch.device) -> dict:
    """A GQA decode call (4/2 heads, D 32, two splits) as keyword arguments."""
    gen = generator(21)
    cache = paged_cache([5, 9], PAGE, 2, 32, torch.float32, device, gen)
    v = randn(tuple(cache.cache.shape), torch.float32, device, gen)
    return {
        "q": randn((2, 4, 32), torch.float32, device, gen),
        "k_buffer": cache.cache,
        "v_buffer": v,
        "o": torch.empty(2, 4, 32, device=device),
        "lse": torch.empty(2, 4, device=device),
        "req_to_token": cache.block_table,
        "b_seq_len": cache.seq_lens,
        "attn_logits": torch.empty(2, 4, 2, 33, device=device),
        "num_kv_splits": 2,
        "sm_scale": 0.3,
        "page_size": PAGE,
    }


def _verify_args(device: torch.device) -> dict:
    """An MLA verify call (8 heads, Lk 48 = 32 + 16, qlen 2, two splits) as keyword arguments."""
    gen = generator(22)
    cache = paged_cache([6, 11], PAGE, 1, 48, torch.float32, device, gen)
    k = cache.cache.to(torch.bfloat16)
    return {
        "q": randn((4, 8, 48), torch.bfloat16, device, gen),
        "k_buffer": k,
        "v_buffer": k[..., :32],
        "o": torch.empty(4, 8, 32, dtype=torch.bfloat16, device=device),
        "lse": torch.empty(4, 8, device=device),
        "req_to_token": cache.block_table,
        "seq_lens": cache.seq_lens,
        "real_seq_lens": None,
        "qlen": 2,
        "attn_logits": torch.empty(4, 8, 2, 33, device=device),
        "num_kv_splits": 2,
        "sm_scale": 0.3,
        "page_size": PAGE,
    }


def _turboquant_args(device: torch.device) -> dict:
    """A 4-bit TurboQuant decode call (4/2 heads, D 32, three splits, given buffers with a spare
    request) as keyword arguments, its cache written by the store."""
    from tests.test_serving import _turboquant_case

    case = _turboquant_case(device, generator(24), seq_lens=[7, 12])
    config = case["config"]
    return {
        "query": case["query"],
        "kv_cache": case["cache"],
        "block_table": case["table"],
        "seq_lens": case["seq_lens"],
        "Pi": None,
        "centroids": case["centroids"],
        "scale": 0.3,
        "mse_bits": config.key_mse_bits,
        "key_packed_size": config.key_packed_size,
        "value_quant_bits": config.value_quant_bits,
        "value_packed_size": config.value_packed_size,
        "PiT": case["pit"],
        "mid_o_buf": torch.empty(3, 4, 3, 33, device=device),
        "output_buf": torch.empty(3, 4, 32, dtype=torch.float16, device=device),
        "lse_buf": torch.empty(3, 4, device=device),
        "max_num_kv_splits": 3,
    }


def _shifted_cache(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``cache`` starting ``offset`` bytes into a fresh allocation."""
    moved = torch.empty(cache.numel() + offset, dtype=torch.uint8, device=cache.device)[offset:].view(cache.shape)
    return moved.copy_(cache)


def _count_plans(monkeypatch: pytest.MonkeyPatch, module, name: str) -> list[int]:
    """Count calls of ``module.name`` (a plan builder) from now on, ``module._PLANS`` empty at first."""
    monkeypatch.setattr(module, "_PLANS", Plans())
    calls = [0]
    builder = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return builder(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_repeated_layout_is_planned_once(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layout, new tensors: one plan. A misaligned query (a view one element in) gets its own
    (Triton compiles a pointer's 16-byte alignment into the kernel)."""
    plans = _count_plans(monkeypatch, dec, "_plan_decode")
    args = _decode_args(device)
    dec.decode_attention_fwd(**args)
    dec.decode_attention_fwd(**{**args, "q": args["q"].clone(), "o": torch.empty_like(args["o"])})
    assert plans[0] == 1
    shifted = torch.empty(args["q"].numel() + 1, device=device)[1:].view(args["q"].shape)
    shifted.copy_(args["q"])
    o = torch.empty_like(args["o"])
    dec.decode_attention_fwd(**{**args, "q": shifted, "o": o})
    assert plans[0] == 2
    torch.testing.assert_close(o, args["o"], rtol=0, atol=0)


def test_turboquant_repeated_layout_is_planned_once(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same layout, new tensors: one plan, the same result. A misaligned output buffer (a view one
    element in, which the merge writes) gets its own plan; so does a cache that moved from a
    16-byte to a 4-byte aligned start (the decode reads 32-bit words: the key holds the 4-byte
    alignment too)."""
    plans = _count_plans(monkeypatch, ttq, "_plan_decode")
    args = _turboquant_args(device)
    out = ttq.triton_turboquant_decode_attention_v2(**args).clone()
    again = ttq.triton_turboquant_decode_attention_v2(**{**args, "query": args["query"].clone(),
                                                         "centroids": args["centroids"].clone()})  # fmt: skip
    assert plans[0] == 1
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    buf = args["output_buf"]
    shifted = torch.empty(buf.numel() + 1, dtype=buf.dtype, device=device)[1:].view(buf.shape)
    got = ttq.triton_turboquant_decode_attention_v2(**{**args, "output_buf": shifted})
    assert plans[0] == 2 and got.data_ptr() == shifted.data_ptr()
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    moved = ttq.triton_turboquant_decode_attention_v2(**{**args, "kv_cache": _shifted_cache(args["kv_cache"], 4)})
    assert plans[0] == 3
    torch.testing.assert_close(moved, out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="kv_cache: expected a 4-byte aligned start"):
        ttq.triton_turboquant_decode_attention_v2(**{**args, "kv_cache": _shifted_cache(args["kv_cache"], 2)})


def test_turboquant_reads_new_centroids_on_every_call(device: torch.device) -> None:
    """Centroids rewritten in place (same tensor, same layout): the next call uses them."""
    args = _turboquant_args(device)
    before = ttq.triton_turboquant_decode_attention_v2(**args).clone()
    args["centroids"].mul_(0.5)
    halved = ttq.triton_turboquant_decode_attention_v2(**args).clone()
    assert not torch.equal(halved, before)
    fresh_args = {**args, "centroids": args["centroids"].clone(), "output_buf": torch.empty_like(args["output_buf"])}
    fresh = ttq.triton_turboquant_decode_attention_v2(**fresh_args)
    torch.testing.assert_close(halved, fresh, rtol=0, atol=0)


def test_plans_find_the_last_key_and_every_earlier_one() -> None:
    plans = Plans()
    plans.add((1, (2, 3)), "a")
    plans.add((4,), "b")
    assert plans.get((4,)) == "b"  # the last one, by comparison
    assert plans.get((1, (2, 3))) == "a"  # an earlier one, from the dictionary (now the last)
    assert plans.get((1, (2, 3))) == "a"
    assert plans.get((4,)) == "b"
    assert plans.get((5,)) is None
    with pytest.raises(TypeError):
        plans.get(([1],))


def test_alternating_layouts_keep_their_plans(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layouts called in turn: two plans, each call its own layout's result."""
    plans = _count_plans(monkeypatch, dec, "_plan_decode")
    wide = _decode_args(device)
    narrow = {**wide, "num_kv_splits": 1, "attn_logits": None}
    outputs = []
    for args in (wide, narrow, wide, narrow):
        o = torch.empty_like(wide["o"])
        dec.decode_attention_fwd(**{**args, "o": o})
        outputs.append(o)
    assert plans[0] == 2
    torch.testing.assert_close(outputs[2], outputs[0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[3], outputs[1], rtol=0, atol=0)


# (what changes, the changed arguments, the error it must raise)
DECODE_CHANGES = [
    ("page_size as a float", lambda a: {"page_size": float(PAGE)}, (ValueError, "page_size")),
    ("num_kv_splits as a float", lambda a: {"num_kv_splits": 2.0}, (ValueError, "num_kv_splits")),
    ("logit_cap as a NumPy float32", lambda a: {"logit_cap": np.float32(0.0)}, (ValueError, "logit_cap")),
    ("sliding_window as a float", lambda a: {"sliding_window": 4.0}, (ValueError, "sliding_window")),
    ("o in int32", lambda a: {"o": a["o"].int()}, (TypeError, "o: expected dtype")),
    # on a GPU the meta tensor first fails the compiled path's CUDA check: either message names o
    ("o on another device", lambda a: {"o": a["o"].to("meta")}, (ValueError, "o: expected (device|a CUDA tensor)")),
    ("q not a tensor", lambda a: {"q": a["q"].cpu().numpy()}, (TypeError, "q: expected a torch.Tensor")),
    (
        "o with a strided last dim",
        lambda a: {"o": torch.empty(2, 4, 64, device=a["o"].device)[..., ::2]},
        (ValueError, "o: the last dimension"),
    ),
    (
        "a workspace for 3 splits",
        lambda a: {"attn_logits": torch.empty(2, 4, 3, 33, device=a["o"].device)},
        (ValueError, "attn_logits"),
    ),
    (
        "an integer k_scale",
        lambda a: {"k_scale": torch.ones((), dtype=torch.int32, device=a["o"].device)},
        (TypeError, "k_scale"),
    ),
]


# (what changes, the changed arguments, the error it must raise)
TURBOQUANT_CHANGES = [
    ("max_num_kv_splits as a float", lambda a: {"max_num_kv_splits": 3.0}, (ValueError, "max_num_kv_splits")),
    ("mse_bits for another preset", lambda a: {"mse_bits": 3}, (ValueError, "key_packed_size")),
    (
        "value_packed_size off by one",
        lambda a: {"value_packed_size": a["value_packed_size"] + 1},
        (ValueError, "value_packed_size"),
    ),
    (
        "the cache's 4-byte alignment lost",
        lambda a: {"kv_cache": _shifted_cache(a["kv_cache"], 2)},
        (ValueError, "4-byte aligned"),
    ),
    ("no rotation", lambda a: {"PiT": None}, (ValueError, "Pi, PiT")),
    ("centroids in float16", lambda a: {"centroids": a["centroids"].half()}, (TypeError, "centroids")),
    ("output_buf in bfloat16", lambda a: {"output_buf": a["output_buf"].bfloat16()}, (TypeError, "output_buf")),
    ("a mid_o_buf for 2 splits", lambda a: {"mid_o_buf": a["mid_o_buf"][:, :, :2]}, (ValueError, "mid_o_buf")),
    ("lse_buf for one request", lambda a: {"lse_buf": a["lse_buf"][:1]}, (ValueError, "lse_buf")),
    ("a block table one row short", lambda a: {"block_table": a["block_table"][:1]}, (ValueError, "block_table")),
    ("seq_lens in float32", lambda a: {"seq_lens": a["seq_lens"].float()}, (TypeError, "seq_lens")),
    ("query not a tensor", lambda a: {"query": a["query"].cpu().numpy()}, (TypeError, "query")),
    ("a kv_cache with a strided slot", lambda a: {"kv_cache": a["kv_cache"][..., ::2]}, (ValueError, "kv_cache")),
]


@pytest.mark.parametrize(("change", "changed", "error"), TURBOQUANT_CHANGES, ids=[c[0] for c in TURBOQUANT_CHANGES])
def test_turboquant_checks_a_call_that_differs_from_a_planned_one(change, changed, error, device) -> None:
    args = _turboquant_args(device)
    ttq.triton_turboquant_decode_attention_v2(**args)
    kind, match = error
    with pytest.raises(kind, match=match):
        ttq.triton_turboquant_decode_attention_v2(**{**args, **changed(args)})


@pytest.mark.parametrize(("change", "changed", "error"), DECODE_CHANGES, ids=[c[0] for c in DECODE_CHANGES])
def test_decode_checks_a_call_that_differs_from_a_planned_one(change, changed, error, device) -> None:
    args = _decode_args(device)
    dec.decode_attention_fwd(**args)
    kind, match = error
    with pytest.raises(kind, match=match):
        dec.decode_attention_fwd(**{**args, **changed(args)})


def test_verify_checks_that_v_is_a_view_of_this_k(device: torch.device) -> None:
    """A V of another cache with V's exact layout (dtype, shape, strides, alignment) is refused."""
    args = _verify_args(device)
    mla_verify.decode_attention_fwd_verify(**args)
    other = args["k_buffer"].clone()
    with pytest.raises(ValueError, match=r"v_buffer: expected k_buffer\[..., :Lv\]"):
        mla_verify.decode_attention_fwd_verify(**{**args, "v_buffer": other[..., :32]})
    with pytest.raises(ValueError, match="qlen"):
        mla_verify.decode_attention_fwd_verify(**{**args, "qlen": 2.0})


def test_merges_check_a_call_that_differs_from_a_planned_one(device: torch.device) -> None:
    gen = generator(23)
    outs = [randn((6, 2, 16), torch.float32, device, gen) for _ in range(3)]
    lses = [randn((2, 6), torch.float32, device, gen) for _ in range(2)]
    lse_merge.merge_attn_states(outs[0], outs[1], lses[0], outs[2], lses[1], prefill_tokens_with_context=3)
    with pytest.raises(ValueError, match="prefill_tokens_with_context"):
        lse_merge.merge_attn_states(outs[0], outs[1], lses[0], outs[2], lses[1],
                                    prefill_tokens_with_context=np.int64(3))  # fmt: skip
    partials = randn((3, 2, 4, 17), torch.float32, device, gen)
    o, lse = torch.empty(3, 2, 16, device=device), torch.empty(3, 2, device=device)
    lse_merge.merge_splits(partials, o, lse)
    with pytest.raises(TypeError, match="lse: expected dtype"):
        lse_merge.merge_splits(partials, o, lse.to(torch.int32))


def test_turboquant_content_checks_run_on_every_call(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table entry and then a length corrupted in place, same layout as a planned call."""
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    args = _turboquant_args(device)
    ttq.triton_turboquant_decode_attention_v2(**args)
    table = args["block_table"]
    saved = table[1, 0].clone()
    table[1, 0] = -1
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 0\] = -1"):
        ttq.triton_turboquant_decode_attention_v2(**args)
    table[1, 0] = saved
    args["seq_lens"][0] = -3
    with pytest.raises(ValueError, match="seq_lens: expected >= 0, got -3"):
        ttq.triton_turboquant_decode_attention_v2(**args)


@pytest.mark.parametrize("op", ["decode", "verify"])
def test_content_checks_run_on_every_call(op: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table entry corrupted in place, same layout as a planned call: the check still reads it."""
    monkeypatch.setenv(CONTENT_CHECKS_ENV, "1")
    args = _decode_args(device) if op == "decode" else _verify_args(device)
    call = dec.decode_attention_fwd if op == "decode" else mla_verify.decode_attention_fwd_verify
    call(**args)
    args["req_to_token"][1, 0] = -1
    with pytest.raises(ValueError, match=r"req_to_token: entry \[1, 0\] = -1"):
        call(**args)


def test_plans_keep_no_caller_tensor_alive(device: torch.device) -> None:
    """A plan holds layouts and launch arguments, never the tensors it was made from."""
    args = _decode_args(device)
    dec.decode_attention_fwd(**args)
    verify = _verify_args(device)
    mla_verify.decode_attention_fwd_verify(**verify)
    tq_args = _turboquant_args(device)
    ttq.triton_turboquant_decode_attention_v2(**tq_args)
    given = [*args.values(), *verify.values(), *tq_args.values()]
    refs = [weakref.ref(t) for t in given if isinstance(t, torch.Tensor)]
    given.clear()
    del args, verify, tq_args
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_descriptors_are_remembered_by_address_without_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan builds a cache's tensor descriptors once per address (compiled mode): the same objects on the next
    call, new ones for another cache, each with the address, dtype, shape, strides and boxes of descriptors built on
    the tensor itself, and none keeps its cache alive."""
    monkeypatch.setattr(launch, "INTERPRETING", False)
    built: list = []

    def make(cache, layout):
        built.append(cache)
        return decode_attention_sm90.descriptors(cache, layout)

    by_address = DescriptorsByAddress(make)
    cache = torch.zeros(4 * 64, 576, dtype=torch.bfloat16)
    layout = dec.tma_layout(cache.view(4, 64, 1, 576), 64, 64 * 576, 576, 4, 64, 512, 64)
    first = by_address(cache, layout)
    assert by_address(cache, layout) is first and len(built) == 1 and not isinstance(built[0], torch.Tensor)
    for remembered, fresh in zip(first, decode_attention_sm90.descriptors(cache, layout)):
        assert remembered.base.data_ptr() == fresh.base.data_ptr() and remembered.base.dtype == fresh.base.dtype
        assert (remembered.shape, remembered.strides, remembered.block_shape) == (
            fresh.shape, fresh.strides, fresh.block_shape)  # fmt: skip
    other = torch.zeros_like(cache)
    assert by_address(other, layout)[0].base.data_ptr() == other.data_ptr() and len(built) == 2
    freed = weakref.ref(cache)
    del cache, fresh  # the test's own descriptors built on the tensor
    gc.collect()
    assert freed() is None


def test_descriptor_launcher_passes_what_triton_s_wrapper_passes_encoding_each_descriptor_once(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``launch._DescriptorLauncher`` against a model of Triton 3.6's launcher (``wrap_handle_tensordesc``: a Python
    function closing over the C ``launcher``, the descriptor indices and their metadata, which encodes every
    descriptor on every call): the C launcher gets the same arguments, each descriptor is encoded once over repeated
    calls, a launcher of another shape is declined, and so is one with a descriptor past the varying arguments."""
    from triton.backends.nvidia import driver as nvidia

    encoded: list = []

    def encode(desc, meta):
        encoded.append(desc)
        return [("map", desc, meta), 7, 8, 1]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)

    def wrap(launcher, indices, tensordesc_meta):  # Triton 3.6's wrapper, its names and argument order
        tensordesc_indices = set(indices)

        def inner(*args):
            final_args = list(args[:13])
            tensordesc_idx = 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    final_args.extend(encode(arg, tensordesc_meta[tensordesc_idx]))
                    tensordesc_idx += 1
                else:
                    final_args.append(arg)
            return launcher(*final_args)

        return inner

    class Run:  # a CompiledKernel's run, as Triton 3.6 builds it
        def __init__(self, indices, scratch=0):
            self.calls: list = []
            self.launch = wrap(lambda *args: self.calls.append(args), indices, ["m1", "m2"])
            self.global_scratch_size, self.profile_scratch_size = scratch, 0
            self.launch_cooperative_grid, self.launch_pdl = False, True

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)

    head, params = ("q", "cache", object(), object()), (3, 16)
    reference, mine = Run([2, 3]), Run([2, 3])
    fast = launch._DescriptorLauncher.of(mine, len(head))
    assert fast is not None
    for _ in range(3):
        reference(4, 8, 2, 99, "fn", "packed", None, None, None, *head, *params)
        fast(4, 8, 2, 99, "fn", "packed", head, params)
    assert mine.calls == reference.calls and len(mine.calls) == 3
    assert encoded.count(head[2]) == 4 and encoded.count(head[3]) == 4  # 3 by the reference, 1 by the fast path
    assert launch._DescriptorLauncher.of(Run([2, 3], scratch=64), len(head)) is None
    assert launch._DescriptorLauncher.of(Run([2, 5]), len(head)) is None
    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKOOOO")
    assert launch._DescriptorLauncher.of(Run([2, 3]), len(head)) is None


def test_the_interpreter_builds_descriptors_on_the_cache_itself() -> None:
    """Under the interpreter (which reads the cache through the descriptor) every call builds them on the tensor."""
    by_address = DescriptorsByAddress(dec.tma_descriptors)
    cache = torch.zeros(4 * 64, 576, dtype=torch.bfloat16)
    layout = dec.tma_layout(cache.view(4, 64, 1, 576), 64, 64 * 576, 576, 4, 64, 512, 64)
    if not launch.INTERPRETING:
        pytest.skip("compiled mode: the descriptors are remembered (the test above)")
    first = by_address(cache, layout)
    assert first[0].base is cache and by_address(cache, layout)[0] is not first[0]
    assert by_address(cache, None) == (None, None)


def test_cpu_benchmark_takes_the_cached_path_for_every_serving_case() -> None:
    """The benchmark raises if a timed call launches through ``JITFunction.run`` (a missed plan or
    launch cache); every case of ``benchmarks/serving.py`` appears in its table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "benchmarks/host_overhead_cpu.py", "--calls", "5"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    from benchmarks.serving import CASES

    for name, *_ in CASES:
        assert f"| {name} |" in result.stdout


@pytest.mark.parametrize(("name", "first", "second"), [("sm_scale", 0.3, 0.25), ("sliding_window", 5, 3),
                                                       ("logit_cap", 1.0, 2.0)])  # fmt: skip
def test_a_decode_plan_is_never_reused_for_another_value_of_a_scalar(name: str, first, second, device) -> None:
    """Two calls of one layout that differ in the value (not the type) of one scalar the launch takes (the softmax
    scale, the window, the logit cap) get the second call's own results, the bits of the same call on a fresh plan:
    a plan key without that value would hand the second call the first call's launch."""

    def call(value) -> tuple[torch.Tensor, torch.Tensor]:
        args = _decode_args(device) | {name: value}
        dec.decode_attention_fwd(**args)
        return args["o"], args["lse"]

    forget_plans()
    before = call(first)
    cached = call(second)
    forget_plans()
    fresh = call(second)
    assert not torch.equal(fresh[1], before[1])  # the scalar changes the result
    for got, want in zip(cached, fresh):
        assert_bits_equal(got, want)


def test_a_merge_plan_is_never_reused_for_the_other_partial_dtype(device) -> None:
    """``merge_splits`` of the same tensors with bf16 and fp32 partials (``bf16_values``): each gets its own plan,
    so the second call reads its partials as it was told to."""
    gen = generator(23)
    partials = torch.randn(3, 2, 4, 33, generator=gen).to(device)
    results = {}
    for bf16 in (False, True, False):
        o, lse = torch.empty(3, 2, 32, device=device), torch.empty(3, 2, device=device)
        lse_merge.merge_splits(partials, o, lse, bf16_values=bf16)
        results.setdefault(bf16, []).append(o.clone())
    forget_plans()
    o, lse = torch.empty(3, 2, 32, device=device), torch.empty(3, 2, device=device)
    lse_merge.merge_splits(partials, o, lse, bf16_values=True)
    assert_bits_equal(results[True][0], o)
    assert_bits_equal(results[False][1], results[False][0])
    assert bool((results[True][0].view(torch.int32) != results[False][0].view(torch.int32)).any())


def test_forget_plans_empties_every_wrapper_s_plans() -> None:
    """A sweep edits a config table and calls ``forget_plans``: no plan made from the old table survives."""
    first, second = Plans(), Plans()
    first.add(("a",), 1)
    second.add(("b",), 2)
    forget_plans()
    assert first.get(("a",)) is None and second.get(("b",)) is None


def test_launch_hooks_count_as_active_only_when_they_would_run() -> None:
    """``Launch`` skips ``launch_metadata`` and the hook calls when no hook would run: None, or an
    empty ``HookChain`` (Triton's default); a chain holding a call, or a plain callable, is active."""
    from triton import knobs

    from triton_impl.launch import _hook_active

    chain = knobs.HookChain()
    assert not _hook_active(None) and not _hook_active(chain)
    chain.add(print)
    assert _hook_active(chain) and _hook_active(print)
