"""Snapshot identity, fingerprints, manifests and the store that decides what is safe to restore."""
