"""Hierarchical ZeRO's per-rank shard files: the format its engine writes (format.py) and the shards themselves
(shards.py: save, load, layout checks, offline merge)."""
