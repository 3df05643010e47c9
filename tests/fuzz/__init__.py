"""Coverage-guided fuzz targets (atheris, libFuzzer) of every reader of outside bytes: one
module per target, each runnable alone (`python -m tests.fuzz.NAME [libFuzzer flags]`);
`python -m tests.fuzz` runs them all one after another (`make fuzz`)."""
