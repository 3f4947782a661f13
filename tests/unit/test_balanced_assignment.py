"""Exactness, cluster sizes and input validation of the balanced assignment (CMoE Eq. 11-13)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from moeify.moe.experts.balanced_assignment import _cancel_negative_cycles, balanced_assignment


def _sizes(n: int, k: int) -> list[int]:
    """k sizes summing to n that differ by at most one, the larger ones first."""
    return [n // k + (j < n % k) for j in range(k)]


def _optimal_cost(costs: np.ndarray, sizes: list[int]) -> float:
    """The paper's reference: Jonker-Volgenant with column j repeated sizes[j] times."""
    extended = np.repeat(costs, sizes, axis=1)
    rows, cols = linear_sum_assignment(extended)
    return float(extended[rows, cols].sum())


def _check(costs: np.ndarray, sizes: list[int], labels: torch.Tensor) -> None:
    assert labels.dtype == torch.long and labels.shape == (costs.shape[0],)
    labels_np = labels.numpy()
    assert np.bincount(labels_np, minlength=len(sizes)).tolist() == list(sizes)
    cost = float(costs[np.arange(costs.shape[0]), labels_np].sum())
    assert cost == pytest.approx(_optimal_cost(costs, sizes), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(
    ("n", "k", "seed"),
    [(40, 4, 0), (172, 8, 1), (172, 14, 2), (150, 7, 3), (97, 5, 4), (300, 14, 5)],
)
def test_matches_scipy_on_extended_matrix(n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    features = (rng.random((n, 32)) < 0.3).astype(np.float64)
    centroids = rng.random((k, 32))
    costs = np.linalg.norm(features[:, None, :] - centroids[None], axis=-1)
    sizes = _sizes(n, k)
    _check(costs, sizes, balanced_assignment(costs, sizes))
    if n % k == 0:
        _check(costs, sizes, balanced_assignment(costs, n // k))


def test_uniform_random_costs_and_uneven_sizes() -> None:
    rng = np.random.default_rng(6)
    costs = rng.random((120, 5))
    sizes = [50, 0, 31, 1, 38]
    _check(costs, sizes, balanced_assignment(costs, sizes))


def test_all_rows_prefer_one_cluster() -> None:
    rng = np.random.default_rng(7)
    costs = 1.0 + rng.random((140, 7))
    costs[:, 3] = rng.random(140) * 1e-3
    _check(costs, _sizes(140, 7), balanced_assignment(costs, 20))


def test_ties_all_equal_costs() -> None:
    costs = np.full((60, 6), 2.5)
    labels = balanced_assignment(costs, 10)
    _check(costs, [10] * 6, labels)


def test_ties_few_distinct_integer_costs() -> None:
    rng = np.random.default_rng(8)
    costs = rng.integers(0, 3, size=(90, 6)).astype(np.float64)
    _check(costs, [15] * 6, balanced_assignment(costs, 15))


def test_single_cluster() -> None:
    costs = np.random.default_rng(9).random((17, 1))
    labels = balanced_assignment(costs, 17)
    assert labels.tolist() == [0] * 17
    assert balanced_assignment(costs, [17]).tolist() == [0] * 17


def test_torch_float32_and_numpy_float32_inputs() -> None:
    generator = torch.Generator().manual_seed(10)
    points = torch.rand(84, 16, generator=generator)
    distances = torch.cdist(points, torch.rand(6, 16, generator=generator))
    costs = distances.double().numpy()
    from_torch = balanced_assignment(distances, 14)
    _check(costs, [14] * 6, from_torch)
    from_numpy = balanced_assignment(distances.numpy(), torch.tensor([14] * 6))
    _check(costs, [14] * 6, from_numpy)


def test_integer_costs_and_large_offset() -> None:
    rng = np.random.default_rng(11)
    costs = rng.integers(0, 1000, size=(80, 4))
    _check(costs.astype(np.float64), [20] * 4, balanced_assignment(costs, 20))
    shifted = 1e6 + rng.random((80, 4))
    _check(shifted, [20] * 4, balanced_assignment(shifted, 20))


def test_exact_despite_extreme_cost_range() -> None:
    # One huge entry makes the integer scaling far too coarse for the others; the negative-cycle
    # certification on the float costs must still reach the exact optimum.
    rng = np.random.default_rng(12)
    costs = rng.random((200, 8))
    costs[0, 0] = 1e15
    labels = balanced_assignment(costs, 25).numpy()
    cost = costs[np.arange(200), labels].sum()
    assert cost == pytest.approx(_optimal_cost(costs, [25] * 8), rel=1e-12)


def test_cycle_cancelling_alone_reaches_the_optimum() -> None:
    rng = np.random.default_rng(13)
    costs = rng.random((75, 5))
    sizes = [15, 16, 14, 20, 10]
    start = rng.permutation(np.repeat(np.arange(5), sizes))
    labels = _cancel_negative_cycles(costs, start)
    assert np.bincount(start).tolist() == sizes  # input left untouched
    _check(costs, sizes, torch.from_numpy(labels))


@pytest.mark.parametrize(
    ("distances", "capacity", "message"),
    [
        (np.zeros(12), 3, r"2-D \(n, k\) matrix, got 1-D"),
        (np.zeros((2, 3, 2)), 1, r"got 3-D with shape \(2, 3, 2\)"),
        (np.zeros((4, 0)), 1, r"at least one column"),
        (np.array([[1.0, np.nan], [0.0, 1.0]]), 1, r"distances\[0, 1\] = nan"),
        (torch.tensor([[1.0, 2.0], [float("inf"), 0.0]]), 1, r"distances\[1, 0\] = inf"),
        (np.ones((2, 2), dtype=bool), 1, r"real-valued, got dtype bool"),
        (np.ones((2, 2), dtype=complex), 1, r"real-valued, got dtype complex128"),
        (np.zeros((10, 3)), 3, r"k\*capacity=9 rows, but distances has n=10 rows"),
        (np.zeros((6, 3)), -2, r"non-negative, got -2"),
        (np.zeros((6, 3)), [2, 2], r"expected k=3 entries, got 2"),
        (np.zeros((6, 3)), [4, 3, -1], r"capacity\[2\] = -1"),
        (np.zeros((6, 3)), [2, 2, 3], r"capacities sum to 7, but distances has n=6 rows"),
        (np.zeros((6, 3)), [2.0, 2.0, 2.0], r"must contain ints, got dtype float64"),
        (np.zeros((6, 3)), 2.0, r"an int or a sequence of k=3 ints, got float 2.0"),
        (np.zeros((6, 3)), True, r"an int or a sequence of k=3 ints, got bool"),
    ],
)
def test_bad_inputs_raise_value_error(distances: object, capacity: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_assignment(distances, capacity)
