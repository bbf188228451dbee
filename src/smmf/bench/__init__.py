"""Benchmarks, reports and model zoos: everything outside the optimizer core."""
