"""Memory accounting: the guard, the fit arithmetic, model costs and RAM readings."""
