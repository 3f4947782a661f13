"""Plain helpers shared by the tests (and usable from scripts): no fixtures here, those live in
``tests/conftest.py``, which imports what it needs from these modules.

- ``tiny_models``: tiny randomly initialised causal LMs of every supported family.
- ``conversion``: copying a model and building a CPU conversion context.
- ``data``: the ../shared assets folder and the held-out TinyStories slice.
- ``weights``: random MLP weights, and bit-exact comparison of two models' weights.
- ``killing``: interrupting the training loop part-way, to test resuming.
- ``remote``: running saved folders in a fresh process that cannot import moeify.
- ``golden.json``: the golden numbers of ``tests/unit/test_golden.py``.
"""
