"""The daemon: the one composition root (`Daemon`), its listeners and token, systemd lifecycle and the
state-directory lock."""
