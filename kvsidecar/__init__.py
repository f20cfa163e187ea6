"""kvsidecar: a KV-cache persistence daemon for llama-server.

The harness' session log is the truth; a KV snapshot is a disposable cache. Anything missing, stale, corrupt
or incompatible costs a cold prefill, never a wrong conversation.
"""

__version__ = "0.1.0"
