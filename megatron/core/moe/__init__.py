"""Mixture-of-experts arithmetic below the model: the gate (DeepSpeed's top-1 / top-2 rules), layout-independent
random draws, the sparse dispatch and combine, and the expert-parallel all-to-alls."""
