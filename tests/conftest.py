"""Shared pytest settings: keep every test process single-threaded-ish and quiet."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): upper bound for a multi-process test")
