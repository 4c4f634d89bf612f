"""State of tests/scripts/pool_job.py's ranks that lives on between the calls of one pool: a global of an imported
module (kept in a kept-alive rank; ``__main__``'s globals are the launching process's at each call under fork)."""

CALLS = 0
