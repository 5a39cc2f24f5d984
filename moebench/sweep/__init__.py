"""Sweeps: suite files, the point runner, the results store, Slurm submission and progress."""
