"""Models, data and gradient-sync strategies for the minimal training loop (not built yet)."""
