"""Snapshot identity, manifests, the files on disk and the store that decides what is safe to restore."""
