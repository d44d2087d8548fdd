"""jaxamp's benchmark harness: ``python benchmarks/run.py --help``."""
