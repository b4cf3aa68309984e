"""specloop benchmarks."""
