import os

# Multi-process tests share 2 cores: one thread per process keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
