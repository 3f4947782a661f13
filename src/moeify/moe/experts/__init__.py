"""An MLP's neurons split into shared and routed experts: the partitions (balanced k-means, the exact
balanced assignment, spectral clustering), channel importance, and the ``MoeMLP`` built from a partition."""
