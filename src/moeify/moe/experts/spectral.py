"""Spectral clustering of a co-activation graph, and bounded cluster sizes (MoRE §2.2, §E.5)."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse.linalg
from scipy.cluster.vq import kmeans2


def spectral_clusters(affinity: np.ndarray, r: int, *, seed: int, n_init: int = 10) -> np.ndarray:
    """Partition the vertices of a weighted undirected graph into ``r`` clusters (Ng-Jordan-Weiss):
    embed each vertex by the top-``r`` eigenvectors of D^-1/2 A D^-1/2, normalise the rows, and run
    k-means (k-means++ seeding, best of ``n_init`` restarts by inertia). Isolated vertices (degree 0,
    e.g. channels no calibration token activated) have no spectral embedding; they are put in the
    currently smallest clusters, which keeps sizes even. Returns labels (n,) in [0, r)."""
    a = np.asarray(affinity, dtype=np.float64)
    n = a.shape[0]
    degree = a.sum(axis=1)
    connected = np.flatnonzero(degree > 0)
    labels = np.full(n, -1)
    if len(connected) >= r:
        sub = a if len(connected) == n else a[np.ix_(connected, connected)]  # no copy when all are connected
        scale = 1.0 / np.sqrt(degree[connected])
        normalised = scale[:, None] * sub  # one (n, n) array besides the affinity, scaled in place
        normalised *= scale[None, :]
        del sub
        vectors = top_eigenvectors(normalised, r, seed)
        del normalised
        embedding = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        rng = np.random.default_rng(seed)
        best, best_inertia = None, np.inf
        for _ in range(n_init):
            centroids, found = kmeans2(embedding, r, minit="++", seed=rng)
            inertia = float(((embedding - centroids[found]) ** 2).sum())
            if inertia < best_inertia:
                best, best_inertia = found, inertia
        labels[connected] = best
    for vertex in np.flatnonzero(labels < 0):
        labels[vertex] = int(np.argmin(np.bincount(labels[labels >= 0], minlength=r)))
    return labels


def top_eigenvectors(matrix: np.ndarray, r: int, seed: int) -> np.ndarray:
    """(n, r): eigenvectors of the ``r`` largest eigenvalues of the symmetric ``matrix`` (which it may
    overwrite). Lanczos iterations (ARPACK) cost O(n^2) each where a dense decomposition costs O(n^3): at
    the MLP widths of 7B models that is seconds against minutes per layer on the host, for the same
    subspace (k-means on the normalised rows does not depend on the basis chosen in it). The dense solver
    takes the cases ARPACK cannot: r >= n - 1, or no convergence. The start vector comes from ``seed``, so
    the result is deterministic."""
    n = matrix.shape[0]
    if r < n - 1:
        start = np.random.default_rng(seed).standard_normal(n)
        try:
            return scipy.sparse.linalg.eigsh(matrix, k=r, which="LA", v0=start)[1]
        except scipy.sparse.linalg.ArpackNoConvergence:
            pass
    return scipy.linalg.eigh(matrix, subset_by_index=[n - r, n - 1], overwrite_a=True, check_finite=False)[1]


def bound_cluster_sizes(labels: np.ndarray, affinity: np.ndarray, r: int, min_size: int, max_size: int) -> np.ndarray:
    """Move vertices until every cluster has between ``min_size`` and ``max_size`` members.

    Oversize: the member with the weakest link (sum of affinities) to its own cluster moves to the
    not-full cluster it is most linked to. Undersize: the vertex, from a cluster that can spare one,
    with the largest gain (link to the small cluster minus link to its own) moves in. Each move
    strictly reduces the total violation, so the loop ends. ``affinity`` is symmetric (an undirected graph)."""
    if not (0 < min_size <= max_size and r * min_size <= len(labels) <= r * max_size):
        raise ValueError(f"cluster sizes [{min_size}, {max_size}] cannot hold {len(labels)} vertices in {r} clusters")
    labels = labels.copy()
    a = np.asarray(affinity, dtype=np.float64)
    # link[c, i] = sum of affinities from vertex i to cluster c; a vertex's affinities are read as its row (the
    # matrix is symmetric), so a move updates two contiguous rows, not two strided columns
    link = np.eye(r)[labels].T @ a
    sizes = np.bincount(labels, minlength=r)

    def move(vertex: int, target: int) -> None:
        source = labels[vertex]
        link[source] -= a[vertex]
        link[target] += a[vertex]
        sizes[source] -= 1
        sizes[target] += 1
        labels[vertex] = target

    while sizes.max() > max_size:
        big = int(np.argmax(sizes))
        members = np.flatnonzero(labels == big)
        vertex = int(members[np.argmin(link[big, members])])
        room = np.flatnonzero(sizes < max_size)
        move(vertex, int(room[np.argmax(link[room, vertex])]))
    while sizes.min() < min_size:
        small = int(np.argmin(sizes))
        donors = np.flatnonzero(sizes[labels] > min_size)
        gain = link[small, donors] - link[labels[donors], donors]
        move(int(donors[np.argmax(gain)]), small)
    return labels
