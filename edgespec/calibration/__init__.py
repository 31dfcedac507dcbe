"""What verification costs on this machine and whether batches are exact: the
cost curve, its cache, the kernel choice, background measurement."""
