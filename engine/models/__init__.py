"""Finding, checking, describing, loading and downloading models."""
