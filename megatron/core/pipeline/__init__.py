"""Pipeline schedules on DeepSpeed's engine: compute orders (pure), their simulator, the instruction lists, the
multi-chunk module and the engine that runs them (zero-bubble H1, interleaved 1F1B)."""
