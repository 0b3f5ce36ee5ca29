"""A run's life outside the step: lost and stuck ranks, the job's end, signals, stragglers, failure records and the
save in flight, behind one Supervisor (supervisor.py). Importing the package loads nothing (tools read run_files)."""
