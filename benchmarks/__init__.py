"""Benchmarks run by `make bench`: each prints, as its last line, one JSON object with
`name`, `value`, `baseline`, `ratio` and `unit` (ours vs a baseline run side by side)."""
