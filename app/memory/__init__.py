"""Memory: the KV memory panel, its charts, and the fit check shown before sending."""
