"""The project's benchmarks (see README.md here): scripts run by path
(`python bench/step_bench.py`), the end-to-end benchmark as a package
(`python -m bench.e2e`), and machine.py, the machine description they share."""
