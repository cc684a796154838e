"""The end-to-end training benchmark: `python -m bench.e2e` (see __main__.py and benchmark.py).

Files: model.py (the GPT-style decoder), data.py (synthetic learnable tokens), contenders.py (the
optimizers compared), runner.py (one training run, measured), timing.py (the iteration split),
benchmark.py (all runs, baselines, loss check, size sweep), sweep.py (largest trainable size),
report.py (machine info, table, JSON), plots.py (PNGs, matplotlib optional), progress.py (the bar).
"""
