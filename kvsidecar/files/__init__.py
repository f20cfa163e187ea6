"""The one way kvsidecar touches a file: names validated and opened relative to a held directory, never
through a link (`confined`), written atomically (`atomic`), and every JSON or YAML document of ours read
by one bounded reader (`documents`, with `limits` and `yamlstrict`). Below the store and the runtime
fingerprint, which both keep files."""
