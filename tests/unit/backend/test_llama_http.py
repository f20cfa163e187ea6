"""llama-server knowledge written once (issue 14, item 2): the API key file is read by one function, in
llama-server's own `--api-key-file` format, for the backend and the proxy alike; the engine's token counts
are read from its answers by one function."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvsidecar.backend.llama_http import find_timings, read_api_key, token_counts
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import config_from_mapping
from kvsidecar.errors import ConfigError
from kvsidecar.proxy.app import Proxy
from tests.unit.coordinator_helpers import start_harness


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("sekrit\n", "sekrit"),
        ("sekrit", "sekrit"),
        ("sekrit\r\n", "sekrit"),
        ("# llama-server keys\n\nfirst-key\nsecond-key\n", "first-key"),
        ("  padded  \n", "padded"),
    ],
)
def test_the_key_file_is_read_as_llama_server_reads_it(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "key"
    path.write_text(text)
    assert read_api_key(path, setting="servers.local.api_key_file") == key


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (b"", "holds no key"),
        (b"\n\n  \n", "holds no key"),
        (b"# only a comment\n", "holds no key"),
        (b"two words\n", "cannot carry"),
        (b"caf\xc3\xa9\n", "cannot carry"),
        (b"\xff\xfe\n", "not UTF-8"),
        (b"k" * 70_000, "over"),
    ],
)
def test_an_unusable_key_file_fails_closed(tmp_path: Path, content: bytes, complaint: str) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=complaint) as info:
        read_api_key(path, setting="servers.local.api_key_file")
    assert "servers.local.api_key_file" in info.value.message
    with pytest.raises(ConfigError, match="cannot read"):
        read_api_key(tmp_path / "missing", setting="x")


async def test_backend_and_proxy_send_the_same_key(tmp_path: Path) -> None:
    key = tmp_path / "llama.key"
    key.write_text("# keys, one per line\nkey-one\nkey-two\n")
    (tmp_path / "token").write_text("t" * 32)
    server = {"snapshot_dir": str(tmp_path / "s"), "api_key_file": str(key)}
    config = config_from_mapping(
        {
            "state_dir": str(tmp_path / "state"),
            "servers": {"local": server},
            "api": {"token_file": str(tmp_path / "token")},
            "proxy": {"enabled": True},
        }
    )
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=[])

    backend = LlamaCppBackend.from_config(config.servers["local"], transport=httpx.MockTransport(handle))
    await backend.inspect_slots()
    await backend.aclose()
    h = await start_harness(tmp_path / "h")
    try:
        proxy = Proxy(h.coordinator, config, token="t" * 32, check_host=True)
        assert seen == ["Bearer key-one"] and proxy.llama_auth == b"Bearer key-one"
        await proxy.aclose()
    finally:
        await h.coordinator.aclose()


def test_the_engine_counts_are_read_from_whole_and_streamed_answers() -> None:
    whole = '{"content": "x", "timings": {"prompt_n": 3, "cache_n": 40}}'
    streamed = 'data: {"content": "a"}\n\ndata: {"content": "", "timings": {"prompt_n": 1, "cache_n": 9}}\n\n'
    assert token_counts(find_timings(whole)) == (3, 40)
    assert token_counts(find_timings(streamed)) == (1, 9)
    assert token_counts(find_timings("not json")) == (None, None)
    for odd in ({"prompt_n": -1, "cache_n": True}, {"prompt_n": "3", "cache_n": 1.5}, {}):
        assert token_counts(odd) == (None, None)
