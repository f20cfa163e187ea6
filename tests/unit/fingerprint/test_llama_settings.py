"""llama.cpp's unified binary runs the server as `llama serve ...` (alias `server`): its settings are read
past the subcommand, exactly as llama-server's own command line, and the subcommand is no setting."""

from __future__ import annotations

from kvsidecar.fingerprint.llama_settings import parse_flags, parse_settings, server_args

ARGS = ("-m", "/m.gguf", "--port", "8081", "--swa-full", "-ctk", "q8_0")


def test_the_subcommand_is_not_a_setting() -> None:
    plain = parse_settings(("/usr/bin/llama-server", *ARGS), {})
    for sub in ("serve", "server"):
        unified = parse_settings(("/usr/local/bin/llama", sub, *ARGS), {})
        assert unified.values == plain.values
        assert "?positional" not in unified.values
    assert server_args(("llama", "serve", "-m", "x")) == ["-m", "x"]
    assert server_args(("llama-server", "-m", "x")) == ["-m", "x"]
    # only the first argument is the subcommand: a later stray word is still kept (and fingerprinted)
    assert parse_settings(("llama", "serve", "serve"), {}).values == {"?positional": ("serve",)}


def test_the_doctors_flags_read_past_the_subcommand() -> None:
    flags = parse_flags(("llama", "serve", *ARGS), {"LLAMA_APP_CMD": "serve"})
    assert flags["port"] == "8081" and flags["swa_full"] == "on" and flags["cache_type_k"] == "q8_0"
    # LLAMA_APP_CMD, which the binary sets for its router's children, changes nothing computed
    assert parse_settings(("llama", "serve"), {"LLAMA_APP_CMD": "serve"}).environ == {}
