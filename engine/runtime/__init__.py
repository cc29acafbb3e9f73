"""The engine runtime: the worker thread, its requests and what it reports."""
