"""Benchmarks of splitting along the batch on the testbed (docs/design.md 12): ``measured``, split plans' measured peaks."""
