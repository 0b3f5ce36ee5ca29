"""DeepSpeed's own checkpoint layout (ZeRO-0..3, pipeline, hpZ): the format training writes through DeepSpeed's engines
(format.py), its file names (files.py) and reading them without a process group (read.py)."""
