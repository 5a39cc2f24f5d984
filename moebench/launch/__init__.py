"""Process lifetimes: the leader of a local multi-rank run, each rank's entry, failure files,
parent-death signals and subreapers, multi-node command lines, and isolated process trees.

Nothing here imports torch at module level, so the sweep (which reaches training only through a
subprocess and its record) uses these without importing the trainer.
"""
