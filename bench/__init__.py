"""Benchmarks: ``make bench`` runs every bench/bench_*.py module and prints their tables."""
