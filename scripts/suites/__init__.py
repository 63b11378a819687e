"""Other people's test suites run with every test inside a budget (``scripts/gpu-suites.sh``).

- ``outcomes``: what one test's outcome is, how a failure is described, the outcome files
  (no CuPy, no PyTorch, no pytest needed);
- ``cupy_routed``: a pytest plugin that puts every test of CuPy's own suite inside a budget
  with CuPy routed into it, and records the outcomes;
- ``opinfo``: PyTorch's OpInfo samples on CUDA, unrouted, routed, and with a 1 MiB budget;
- ``compare``: the comparisons and tables, from the outcome files.
"""
