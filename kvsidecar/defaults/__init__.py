"""The commented default configuration (`kvsidecar config init` writes config.yaml from here)."""
