"""tests/gpu/quick.sh's steps: what one short GPU run shows first, their CPU twins, and the summary file."""
