"""`gorgo soak`: the local stack under load with a fault every few minutes (run.py runs
it; judge.py, pure, judges it)."""
