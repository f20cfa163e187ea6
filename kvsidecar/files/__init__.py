"""The one way kvsidecar touches a file: names validated and opened relative to a held directory, never
through a link (`confined`), written atomically (`atomic`), JSON read within caps (`jsonlimits`). Below the
store and the runtime fingerprint, which both keep files."""
