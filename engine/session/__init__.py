"""One chat's session: its prompt ids, prefill, sampling, checkpoints and prefix reuse."""
