"""Checkpoints: saving and resuming every stage, restarts under torchrun, whole-model weight
files read per stage."""
