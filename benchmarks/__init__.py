"""The benchmark harness: ``python -m benchmarks NAME`` (benchmarks/README.md), the benchmark models and the zoo."""
