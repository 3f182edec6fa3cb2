"""The tolerance oracle itself (``triton_impl.tolerances.compare``): every kernel test trusts it, so each of its
rules is tested here at its edge, where a looser oracle (a wider allowance, an element left out, infinities or NaN
let through) would pass what it must fail."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import assert_close, fails_tolerance
from triton_impl.tolerances import Tolerance, compare

TOL = Tolerance(1e-3, 1e-2, "a test entry")
EXPECTED = torch.tensor([0.0, 1.0, -50.0, 3e-7, 7.5], dtype=torch.float64)
ALLOWED = TOL.atol + TOL.rtol * EXPECTED.abs()  # [1e-3, 0.011, 0.501, ~1e-3, 0.076]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
@pytest.mark.parametrize("sign", [1, -1])
def test_each_element_passes_at_its_allowance_and_fails_just_past_it(index: int, sign: int) -> None:
    """``|actual - expected| <= atol + rtol |expected|`` element by element, the first and the last included: at
    the allowance (less a part in 10^9) it passes, a part in 10^6 past it fails, whichever element it is."""
    for factor, ok in ((1 - 1e-9, True), (1 + 1e-6, False)):
        actual = EXPECTED.clone()
        actual[index] += sign * factor * ALLOWED[index]
        result = compare(actual, EXPECTED, TOL)
        assert result.ok == ok, (index, sign, factor, result)
        if not ok:
            assert result.detail == f"worst excess {float(factor * ALLOWED[index] - ALLOWED[index]):.3g} at flat " \
                                   f"index {index}"  # fmt: skip
    assert compare(EXPECTED.clone(), EXPECTED, TOL).ok


def test_the_allowance_is_atol_plus_rtol_of_the_expected_value_not_the_actual() -> None:
    """The relative part scales with ``|expected|``: an actual 10x the expected value is not allowed 10x more."""
    expected = torch.tensor([1.0], dtype=torch.float64)
    assert not compare(torch.tensor([1.012], dtype=torch.float64), expected, TOL).ok  # 0.012 > 0.011
    assert compare(torch.tensor([1.0109], dtype=torch.float64), expected, TOL).ok


@pytest.mark.parametrize(
    ("actual", "expected", "ok"),
    [
        ([math.inf, 1.0], [math.inf, 1.0], True),
        ([-math.inf, 1.0], [-math.inf, 1.0], True),
        ([math.inf, 1.0], [-math.inf, 1.0], False),  # the sign of an infinity
        ([math.inf, 1.0], [1e30, 1.0], False),  # an overflow where golden is finite
        ([1e30, 1.0], [math.inf, 1.0], False),  # a finite value where golden overflows
        ([1.0, -math.inf], [1.0, -math.inf], True),  # the last element too
        ([1.0, -math.inf], [1.0, 0.0], False),
        ([math.nan, 1.0], [math.nan, 1.0], False),  # NaN never passes, not even against NaN
        ([1.0, 1.0], [1.0, math.nan], False),
    ],
)
def test_infinities_must_match_and_nan_never_passes(actual, expected, ok) -> None:
    result = compare(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), TOL)
    assert result.ok == ok, result


def test_a_shape_mismatch_fails_even_when_the_values_broadcast() -> None:
    assert not compare(torch.zeros(1, 3), torch.zeros(3, dtype=torch.float64), TOL).ok
    assert not compare(torch.zeros(4), torch.zeros(3, dtype=torch.float64), TOL).ok


def test_a_derived_bound_widens_only_its_own_elements() -> None:
    """``bound`` adds to each element's allowance (TurboQuant's weight rounding): an error 0.1 past the tolerance
    passes where the bound is 0.2 and fails where it is 0."""
    actual = EXPECTED + ALLOWED + 0.1
    bound = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.0], dtype=torch.float64)
    result = compare(actual, EXPECTED, TOL, bound)
    assert not result.ok and result.detail.endswith("at flat index 4"), result
    bound[4] = 0.2
    assert compare(actual, EXPECTED, TOL, bound).ok
    # The bound counts once: an error a part in 10^6 past tolerance + bound fails.
    assert not compare(EXPECTED + (ALLOWED + bound) * (1 + 1e-6), EXPECTED, TOL, bound).ok


def test_the_test_helpers_compare_actual_against_expected_with_the_bound() -> None:
    """``assert_close`` and ``fails_tolerance`` (every kernel test's and negative control's verdict) are ``compare``
    with the arguments in order: the relative allowance comes from the expected value (1.0111 against 1.0 is 0.0111
    off, over its 0.011; 1.0 against 1.0111 would be allowed 0.011111), and a derived bound is passed on."""
    actual, expected = torch.tensor([1.0111], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    assert fails_tolerance(actual, expected, TOL) and not fails_tolerance(expected, actual, TOL)
    with pytest.raises(AssertionError, match="worst excess"):
        assert_close(actual, expected, TOL)
    assert_close(expected, actual, TOL)
    bound = torch.tensor([0.001], dtype=torch.float64)
    assert not fails_tolerance(actual, expected, TOL, bound)
    assert_close(actual, expected, TOL, bound)


def test_a_lower_precision_actual_is_compared_in_float64() -> None:
    """A float32 output is widened to float64 before the difference: its own rounding is the error measured."""
    expected = torch.tensor([1.0 + 2.0**-30], dtype=torch.float64)
    tight = Tolerance(2.0**-31, 0.0, "tighter than float32's spacing at 1")
    assert not compare(torch.tensor([1.0], dtype=torch.float32), expected, tight).ok
    assert compare(torch.tensor([1.0], dtype=torch.float32), expected, Tolerance(2.0**-29, 0.0, "looser")).ok
