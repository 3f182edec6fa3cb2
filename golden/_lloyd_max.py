"""Lloyd-Max scalar codebooks for one coordinate of a random unit vector (TurboQuant's quantizer).

After a random rotation every coordinate ``x`` of a unit vector in ``R^d`` has the density
``f(x) = C_d (1 - x^2)^((d-3)/2)`` on ``[-1, 1]`` (``(x + 1) / 2 ~ Beta((d-1)/2, (d-1)/2)``),
close to ``N(0, 1/d)`` for large ``d``. A ``b``-bit Lloyd-Max codebook for it minimizes
``E[(x - c(x))^2]``, ``c(x)`` the nearest of ``2^b`` centroids. Everything here is float64 on the
host (numpy), turned into float32 tensors at the end. Paper: papers.md#turboquant.

Used by :mod:`golden.turboquant` (which re-exports :func:`solve_lloyd_max` and
:func:`codebook_distortion`); not an op of its own (hence the underscore).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np
import torch

MODELS = ("gaussian", "beta")
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(256)
_LLOYD_TOL = 1e-13  # on centroids * sqrt(d): converged to ~ float64 resolution
_LLOYD_MAX_ITER = 20_000


def _std_normal_pdf(z: np.ndarray) -> np.ndarray:
    """The standard normal density, 0 at +-inf."""
    finite = np.isfinite(z)
    z = np.where(finite, z, 0.0)
    return np.where(finite, np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi), 0.0)


def gaussian_cell_moments(d: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
    """``int_lo^hi x^k f(x) dx`` for ``k = 0, 1, 2`` under ``N(0, 1/d)``, in closed form.

    With ``a = lo / sigma``, ``b = hi / sigma``: mass ``Q(a) - Q(b)`` (``Q`` the upper tail
    ``erfc(z / sqrt 2) / 2``, which keeps the outer cells' small masses exact to relative
    precision), first moment ``sigma (phi(a) - phi(b))``, second moment ``sigma^2 (mass +
    a phi(a) - b phi(b))``.

    Args:
        d: the dimension; lo, hi: ``[cells]`` float64 cell edges (``+-inf`` allowed).

    Returns:
        ``(mass, first, second)``, each ``[cells]`` float64.
    """
    sigma = 1.0 / math.sqrt(d)
    a, b = lo / sigma, hi / sigma
    upper_tail = np.vectorize(lambda z: 0.5 * math.erfc(z / math.sqrt(2.0)))
    pdf_a, pdf_b = _std_normal_pdf(a), _std_normal_pdf(b)
    a_pdf_a = np.where(np.isfinite(a), a, 0.0) * pdf_a
    b_pdf_b = np.where(np.isfinite(b), b, 0.0) * pdf_b
    mass = upper_tail(a) - upper_tail(b)
    return mass, sigma * (pdf_a - pdf_b), sigma**2 * (mass + a_pdf_a - b_pdf_b)


def beta_cell_moments(d: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
    """The same moments for the exact marginal ``f(x) = C_d (1 - x^2)^((d-3)/2)`` on ``[-1, 1]``.

    With ``x = sin(t)`` the integrand becomes ``C_d cos(t)^(d-2)``, smooth for every ``d >= 2``,
    so 256-point Gauss-Legendre in ``t`` is accurate to ~1e-13 (the tests compare the masses with
    ``scipy.special.betainc``). ``C_d = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2))``.

    Args:
        d: the dimension; lo, hi: ``[cells]`` float64 cell edges in ``[-1, 1]``.

    Returns:
        ``(mass, first, second)``, each ``[cells]`` float64.
    """
    log_c = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    t_lo, t_hi = np.arcsin(lo), np.arcsin(hi)
    half = (t_hi - t_lo) / 2
    t = (t_lo + t_hi)[:, None] / 2 + half[:, None] * _GL_NODES[None, :]
    w = half[:, None] * _GL_WEIGHTS[None, :] * np.exp(log_c + (d - 2) * np.log(np.cos(t)))
    x = np.sin(t)
    return w.sum(1), (w * x).sum(1), (w * x * x).sum(1)


def cell_moments(model: str, d: int, edges: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mass, first and second moment of each cell ``[edges[i], edges[i+1])`` under ``model``."""
    lo, hi = edges[:-1], edges[1:]
    return gaussian_cell_moments(d, lo, hi) if model == "gaussian" else beta_cell_moments(d, lo, hi)


def cell_edges(model: str, centroids: np.ndarray) -> np.ndarray:
    """The nearest-centroid cells: the midpoints between neighbours, and the support's ends."""
    outer = math.inf if model == "gaussian" else 1.0
    return np.concatenate([[-outer], (centroids[:-1] + centroids[1:]) / 2, [outer]])


def _check_codebook_args(d: int, bits: int, model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if not isinstance(d, int) or d < 2:
        raise ValueError(f"d: expected an int >= 2, got {d!r}")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits: expected an int in [1, 8], got {bits!r}")


@functools.lru_cache(maxsize=64)
def lloyd_max_float64(d: int, bits: int, model: str) -> tuple[float, ...]:
    """Lloyd's iteration to its fixed point in float64 (cached by value: d, bits, model)."""
    n = 2**bits
    sigma = 1.0 / math.sqrt(d)
    # Start at the Gaussian quantiles of the cell centres: close to the answer for every model.
    c = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]) * sigma
    for _ in range(_LLOYD_MAX_ITER):
        m0, m1, _m2 = cell_moments(model, d, cell_edges(model, c))
        updated = m1 / m0  # each centroid moves to the conditional mean of its cell
        step = float(np.max(np.abs(updated - c))) / sigma
        c = updated
        if step < _LLOYD_TOL:
            return tuple(float(x) for x in c)
    raise RuntimeError(f"Lloyd-Max did not converge: d={d}, bits={bits}, model={model}")


def solve_lloyd_max(d: int, bits: int, model: str = "gaussian") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``bits``-bit Lloyd-Max codebook of one coordinate of a random unit vector in ``R^d``.

    Lloyd's conditions: each centroid is the conditional mean of its cell, each boundary is the
    midpoint of its two centroids; iterated from the Gaussian quantiles until the centroids move
    less than ``1e-13 / sqrt(d)`` (float64, closed-form Gaussian moments, quadrature for Beta).

    ``model="gaussian"``: ``N(0, 1/d)``, the large-``d`` limit vLLM serves with (``c * sqrt(d)``
    is the same for every ``d``; unit-variance MSE 0.36338, 0.11748, 0.034548, 0.0095010 for
    1..4 bits). ``model="beta"``: the exact marginal ``(x+1)/2 ~ Beta((d-1)/2, (d-1)/2)``
    (TurboQuant's Lemma 1). Paper: papers.md#turboquant.

    Args:
        d: the dimension (>= 2).
        bits: code width, 1..8.
        model: "gaussian" (default, vLLM) or "beta".

    Returns:
        ``(centroids [2^bits], boundaries [2^bits - 1])`` float32, ascending, symmetric about 0;
        ``boundaries`` are the midpoints of the float32 centroids (``(c_i + c_{i+1}) / 2`` in
        float32 is exact up to one rounding). A value exactly on a boundary belongs to the upper
        cell (see ``golden.turboquant.nearest_cell``).

    Traffic: none (host computation, cached).
    """
    _check_codebook_args(d, bits, model)
    centroids = torch.tensor(lloyd_max_float64(d, bits, model), dtype=torch.float32)
    return centroids, (centroids[:-1] + centroids[1:]) / 2


def codebook_distortion(centroids: torch.Tensor, d: int, model: str = "gaussian") -> float:
    """``D_mse = d * E[(X - c(X))^2]`` of a scalar codebook, exactly (no sampling).

    ``X`` is one coordinate of a random unit vector under ``model`` and ``c(X)`` its nearest
    centroid; ``d`` times the per-coordinate error is TurboQuant's ``E ||x - x~||^2`` for unit
    ``x`` (Theorem 1), and for the Gaussian model the unit-variance MSE. Paper:
    papers.md#turboquant.

    Args:
        centroids: ``[N]`` ascending (any float dtype; evaluated in float64).
        d: the dimension; model: "gaussian" or "beta".

    Returns:
        The distortion as a Python float.

    Traffic: none (host computation).
    """
    _check_codebook_args(d, 1, model)
    c = centroids.detach().to("cpu", torch.float64).numpy()
    m0, m1, m2 = cell_moments(model, d, cell_edges(model, c))
    return float(d * np.sum(m2 - 2 * c * m1 + c * c * m0))
