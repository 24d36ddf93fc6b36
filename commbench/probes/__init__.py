"""GPU and host telemetry sampled alongside runs (issue: probes)."""
