"""GPU and host telemetry sampled alongside runs (not built yet)."""
