"""The layout-free full state: its files (files.py), any layout merged into it (merge.py), sharded into a model and an
engine (shard.py), and the format a full-state ``--load`` uses (format.py)."""
