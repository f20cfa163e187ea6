"""Runtime identity: which llama-server state a snapshot may be restored into, and what can be read about
the local llama-server process. Each module owns one part; import a name from its owner:

- `identity`: what is known of each runtime now, its state machine and its one writer, `RuntimeIdentity`;
- `runtime`: the fingerprint's components, `RuntimeFingerprint` and `build_fingerprint`;
- `reasons`: what a difference in each component means (reason codes, `HARMLESS`);
- `model_files`: the loaded model's files and `model_proof`;
- `process_files`: paths and digests as the process sees them;
- `file_digests`: whole-file digests and their cache; `records`: the saved fingerprints' components;
- `llama_process`, `llama_settings`, `llama_args`: the process, its settings, llama-server's option table;
- `llama_exit`: why the process went away; `savepath`: whether it saves where kvsidecar looks;
- `gguf_meta`: a model's GGUF metadata keys and tensor names; `memory_class`: the kind of memory it has.
"""
