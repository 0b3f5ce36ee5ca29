"""Analytic performance model of a layout on Frontier: FLOPs, memory, communication, step time."""
