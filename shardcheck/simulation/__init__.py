"""CP simulated on N ranks, compared with one device."""
