"""An MLP's neurons split into shared and routed experts: the partitions (balanced k-means, the exact
balanced assignment, spectral clustering), channel importance, the ``MoeMLP`` built from a partition, and
the least-squares refit of its output projections."""
