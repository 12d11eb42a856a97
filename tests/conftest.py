"""Suite-wide settings. One CPU thread per process: tests start several worker processes on a 2-core
machine, and oversubscribed OpenMP threads make them many times slower (40 training steps: 25 s with
2 threads per process under load, 0.5 s with 1)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
