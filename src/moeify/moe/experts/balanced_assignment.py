"""Exact balanced assignment of rows to clusters: the assignment step of CMoE's balanced k-means.

CMoE groups the ``n`` routed neurons of an MLP into ``k`` experts of equal size with a balanced
k-means. Its assignment step (CMoE Eq. 11-13) is the transportation problem

    minimise   sum_i sum_j  x_ij * d_ij                           (Eq. 11)
    subject to sum_j x_ij = 1          for every neuron i          (Eq. 12)
               sum_i x_ij = m_j        for every cluster j         (Eq. 13)
               x_ij in {0, 1}

where ``d_ij`` is the distance of neuron ``i`` to centroid ``j`` and ``m_j`` the size of
cluster ``j``. The paper repeats every column ``m_j`` times into an ``n x n`` matrix and runs
Jonker-Volgenant (``scipy.optimize.linear_sum_assignment``), which costs ``O(n^3)``: over a minute
per k-means iteration at ``n = 9632, k = 14`` on two CPU cores. With only ``k`` sinks the same
optimum is a min-cost flow on ``n + k`` nodes and ``n * k`` arcs, which OR-Tools' cost-scaling
push-relabel solves about three orders of magnitude faster (``benchmarks/bench_balanced_assignment.py``).

The solver needs integer costs, so the float costs are scaled and rounded (see
``_min_cost_flow_labels`` for the bound on what that can cost), and the result is then certified
optimal on the float costs themselves: a balanced assignment is optimal exactly when its residual
graph has no negative cycle, and with ``k`` clusters that graph collapses to ``k`` nodes, so the
check (and the cancelling of any cycle that rounding left behind) is cheap
(``_cancel_negative_cycles``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

import numpy as np
import torch
from ortools.graph.python.min_cost_flow import SimpleMinCostFlow

__all__ = ["balanced_assignment"]

# Headroom factor between the largest integer cost and int64, see `_max_integer_cost`.
_OVERFLOW_HEADROOM = 8


def balanced_assignment(
    distances: np.ndarray | torch.Tensor, capacity: int | Sequence[int]
) -> torch.Tensor:
    """Assign each of ``n`` rows to one of ``k`` clusters with fixed cluster sizes at minimum cost.

    Args:
        distances: ``(n, k)`` real matrix (numpy array or torch tensor, any float or int dtype);
            ``distances[i, j]`` is the cost of putting row ``i`` into cluster ``j``. All entries
            must be finite.
        capacity: either one int (every cluster gets exactly ``capacity`` rows, which requires
            ``n == k * capacity``) or a sequence of ``k`` non-negative ints summing to ``n``
            (cluster ``j`` gets exactly ``capacity[j]`` rows).

    Returns:
        LongTensor ``(n,)`` with the cluster index of every row, on the device of ``distances``
        when it is a tensor (on the CPU otherwise). It minimises ``sum_i distances[i, labels[i]]``
        over all assignments with the requested cluster sizes (CMoE Eq. 11-13); among tied optima
        any one may be returned.

    Raises:
        ValueError: ``distances`` is not a finite real 2-D matrix with at least one column, or
            ``capacity`` is not a valid size specification for it.
    """
    costs = _cost_matrix(distances)
    capacities = _capacities(capacity, *costs.shape)
    labels = _cancel_negative_cycles(costs, _min_cost_flow_labels(costs, capacities))
    device = distances.device if isinstance(distances, torch.Tensor) else torch.device("cpu")
    return torch.from_numpy(labels).to(device)


def _cost_matrix(distances: np.ndarray | torch.Tensor) -> np.ndarray:
    """Validate ``distances`` and return it as a float64 numpy array."""
    if isinstance(distances, torch.Tensor):
        if distances.dtype == torch.bool or distances.is_complex():
            raise ValueError(f"distances must be real-valued, got dtype {distances.dtype}")
        array = distances.detach().to(device="cpu", dtype=torch.float64).numpy()
    else:
        array = np.asarray(distances)
        if array.dtype.kind not in "fiu":
            raise ValueError(f"distances must be real-valued, got dtype {array.dtype}")
        array = array.astype(np.float64, copy=False)
    if array.ndim != 2:
        raise ValueError(
            f"distances must be a 2-D (n, k) matrix, got {array.ndim}-D with shape {array.shape}"
        )
    if array.shape[1] == 0:
        raise ValueError(
            f"distances must have at least one column (cluster), got shape {array.shape}"
        )
    bad = ~np.isfinite(array)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(
            f"distances must be finite, but {int(bad.sum())} entries are not "
            f"(first: distances[{row}, {col}] = {array[row, col]})"
        )
    return array


def _capacities(capacity: int | Sequence[int], n: int, k: int) -> np.ndarray:
    """Validate ``capacity`` for an ``(n, k)`` cost matrix and return the ``k`` cluster sizes."""
    if isinstance(capacity, Integral) and not isinstance(capacity, bool):
        if capacity < 0:
            raise ValueError(f"capacity must be non-negative, got {capacity}")
        if k * capacity != n:
            raise ValueError(
                f"capacity={capacity} for each of k={k} clusters holds k*capacity={k * capacity} "
                f"rows, but distances has n={n} rows; pass a sequence of k sizes summing to n "
                f"for unequal clusters"
            )
        return np.full(k, capacity, dtype=np.int64)
    sizes = None if isinstance(capacity, (str, bytes, bool)) else np.asarray(capacity)
    if sizes is None or sizes.ndim != 1:
        raise ValueError(
            f"capacity must be an int or a sequence of k={k} ints, got {type(capacity).__name__} "
            f"{capacity!r}"
        )
    if sizes.shape[0] != k:
        raise ValueError(
            f"capacity must hold one size per cluster: expected k={k} entries, got {sizes.shape[0]}"
        )
    if sizes.dtype.kind not in "iu":
        raise ValueError(f"capacity must contain ints, got dtype {sizes.dtype}: {sizes.tolist()}")
    negative = np.flatnonzero(sizes < 0)
    if negative.size:
        j = negative[0]
        raise ValueError(f"capacities must be non-negative, got capacity[{j}] = {sizes[j]}")
    if sizes.sum() != n:
        raise ValueError(
            f"capacities sum to {int(sizes.sum())}, but distances has n={n} rows; "
            f"they must be equal"
        )
    return sizes.astype(np.int64)


def _max_integer_cost(num_nodes: int) -> int:
    """Largest integer arc cost that OR-Tools' cost scaling can use on ``num_nodes`` nodes safely.

    OR-Tools multiplies every cost by ``num_nodes + 1`` and, by the Goldberg-Tarjan bound, node
    potentials then stay within about ``0.75 * num_nodes * (num_nodes + 1) * max_cost``; keeping
    that ``_OVERFLOW_HEADROOM`` times below ``2**62`` leaves int64 a wide margin. The cap at
    ``2**52`` keeps ``cost * scale`` exact to half a unit in float64.
    """
    return min(2**62 // (_OVERFLOW_HEADROOM * (num_nodes + 1) ** 2), 2**52)


def _min_cost_flow_labels(costs: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """Solve the transportation problem as an integer min-cost flow (rows -> clusters).

    Every row node supplies one unit, cluster ``j`` demands ``capacities[j]`` units, and each of
    the ``n * k`` row->cluster arcs has capacity 1 and the row's cost for that cluster. Each row's
    minimum is subtracted first (that shifts every feasible assignment's cost by the same constant,
    so the optimum is unchanged), then costs are scaled so that the largest one becomes
    ``M = _max_integer_cost(n + k)`` (~6e9 at n = 9632, k = 14) and rounded. Every arc cost moves
    by at most one unit, i.e. ``R / M`` in the original units where ``R`` is the largest shifted
    cost, so the integer optimum is within ``2 * n * R / M`` of the float optimum (~3e-6 * R at
    n = 9632, while the optimum itself is of order ``n`` times a typical cost).
    ``_cancel_negative_cycles`` then removes even that gap.
    """
    n, k = costs.shape
    shifted = costs - costs.min(axis=1, keepdims=True)
    largest = shifted.max(initial=0.0)
    scale = _max_integer_cost(n + k) / largest if largest > 0 else 0.0
    unit_costs = np.rint(shifted * scale).astype(np.int64)

    flow = SimpleMinCostFlow()
    arcs = flow.add_arcs_with_capacity_and_unit_cost(
        np.repeat(np.arange(n, dtype=np.int32), k),
        np.tile(np.arange(n, n + k, dtype=np.int32), n),
        np.ones(n * k, dtype=np.int64),
        unit_costs.ravel(),
    )
    flow.set_nodes_supplies(
        np.arange(n + k, dtype=np.int32), np.concatenate([np.ones(n, np.int64), -capacities])
    )
    status = flow.solve()
    if status != SimpleMinCostFlow.OPTIMAL:
        raise RuntimeError(f"OR-Tools min-cost flow failed with status {status!r}")
    return flow.flows(arcs).reshape(n, k).argmax(axis=1)


def _cancel_negative_cycles(costs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Improve a balanced assignment until no cluster-size-preserving exchange lowers its cost.

    In the residual graph of an assignment, cluster ``a`` reaches cluster ``b`` through any row
    ``i`` now in ``a`` at cost ``costs[i, b] - costs[i, a]``; keeping only the cheapest such row
    per pair gives a ``k``-node graph, and the assignment is optimal iff that graph has no
    negative cycle (moving one row along each arc of a cycle keeps every cluster size). Cycles are
    found with Bellman-Ford and cancelled while one exists. Each cancelled cycle lowers the exact
    cost (its sign is decided with ``math.fsum``), so the loop ends; the result is optimal up to
    cycles whose cost is within float64 rounding of zero. Returns a new array.
    """
    labels = labels.copy()
    while (cycle := _negative_cycle(costs, labels)) is not None:
        rows, targets = cycle
        labels[rows] = targets
    return labels


def _negative_cycle(
    costs: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Return ``(rows, new_clusters)`` of a cost-lowering cycle of row moves, or None."""
    n, k = costs.shape
    exchange = costs - costs[np.arange(n), labels][:, None]
    weight = np.full((k, k), np.inf)  # weight[a, b]: cheapest move of a row from a to b
    mover = np.zeros((k, k), dtype=np.int64)  # the row achieving it
    for a in range(k):
        members = np.flatnonzero(labels == a)
        if members.size:
            best = exchange[members].argmin(axis=0)
            weight[a] = exchange[members[best], np.arange(k)]
            mover[a] = members[best]
    np.fill_diagonal(weight, np.inf)

    # Bellman-Ford from a virtual source joined to every cluster at cost 0: without a negative
    # cycle it settles within k - 1 rounds, so an improvement in round k exposes one.
    dist = np.zeros(k)
    pred = np.full(k, -1)
    for _ in range(k):
        through = dist[:, None] + weight
        via = through.argmin(axis=0)
        candidate = through[via, np.arange(k)]
        improved = candidate < dist
        if not improved.any():
            return None
        dist[improved] = candidate[improved]
        pred[improved] = via[improved]

    cycle = _predecessor_cycle(pred)
    if cycle is None:
        return None
    rows = mover[pred[cycle], cycle]
    change = math.fsum(np.concatenate([costs[rows, cycle], -costs[rows, labels[rows]]]))
    return (rows, cycle) if change < 0 else None


def _predecessor_cycle(pred: np.ndarray) -> np.ndarray | None:
    """Nodes of a cycle of the predecessor map ``pred`` (-1 = none), or None if it has none."""
    k = pred.shape[0]
    for start in range(k):
        node = start
        for _ in range(k):
            node = pred[node]
            if node < 0:
                break
        else:
            # k steps without leaving the map: `node` lies on a cycle.
            cycle = [node]
            while (node := pred[node]) != cycle[0]:
                cycle.append(node)
            return np.array(cycle)
    return None
