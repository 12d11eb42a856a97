"""fivefold dryrun: the real runtime on fake tensors (see docs/dryrun.md)."""
