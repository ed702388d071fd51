"""jaxdist's head-to-head benchmark suite.

Every row times two ways of running the same training step in one process, in alternating blocks,
and reports the ratio of their steps/s (see `benchmarks.timing`). Run it with ``./scripts/bench`` or
``python -m benchmarks --help``; results go to ``benchmarks/results/`` as markdown, JSON and a PNG
plot.

Modules: `models` (the MLPs and data), `runners` (the steppers), `cases` (which rows, with targets),
`timing` (the alternating-block method), `suite` (runs a plan), `report` (tables, JSON, plot).
"""
