"""profile: measure this machine (GEMM throughput, memory bandwidth, collectives) and write a profile file
that `--cluster` accepts, so the cost model plans with measured numbers instead of catalog defaults."""
