"""Runnable examples: osvl's kernels inside other trainers (verl, TRL, torchtitan). Each runs on CPU."""
