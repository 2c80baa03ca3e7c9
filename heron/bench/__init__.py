"""`heron bench`: offline throughput, latency and serving benchmarks, and their report.

Each benchmark prints a table and one JSON line, and can write that record to a file
(``--json-out``) that ``heron bench report`` turns into Markdown/HTML with plots. Modules are
imported lazily by the CLI so that the offline path needs only torch and transformers.
"""
