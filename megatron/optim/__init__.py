"""The optimizer and what steers it: the optimizer from the flags, the LR and weight-decay schedules, the
micro-batch calculator of a batch-size ramp, the schedule rules checked on the config, and the gradient norm."""
