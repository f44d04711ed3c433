"""Goldens in CI: the manifest and the gate."""
