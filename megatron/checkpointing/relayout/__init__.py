"""Resuming a checkpoint of ours at another TP x PP x DP x EP x ZeRO layout, in place: each rank reads only the slices
of weights, fp32 master weights and Adam moments it holds (docs/checkpoints.md, "Resuming at another layout")."""
