"""Training utilities shared by the methods that train."""
