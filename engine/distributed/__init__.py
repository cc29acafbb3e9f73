"""Running one model over several processes (machines) with MLX's distributed engine."""
