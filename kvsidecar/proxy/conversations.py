"""The proxy's table of known conversations (issue 28): digests of each conversation's latest request, per
credential, bounded, in memory only.

Three uses (docs/CLIENTS.md):

- *content identity*: a request that names no session continues the conversation of its credential whose
  messages it extends (`kvsidecar.proxy.client_content`), else starts a new one (`c:<digest>`);
- *divergence*: a turn of a known session whose messages do not extend its last request is reported
  (`PROMPT_DIVERGED`, the message index), and run as auxiliary when it is a side request (much shorter, or
  without the tools: a title or summary that a client sent under the conversation's id);
- *prefix donor*: a new session starts from the snapshot of the conversation of the same credential and
  model that shares the most leading elements with it (the acquire's `prefix_from`).

Nothing here holds a prompt's text: only xxh3 digests of its normalized elements. The credential is a
digest of the client's `Authorization` / `x-api-key` value: conversations of one credential never match,
continue or donate to another's. A wrong guess costs warmth, never correctness: an id only names which KV
to start from, and llama-server reuses only the token-exact common prefix of what its slot holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import xxhash

from kvsidecar.proxy.client_content import (
    KnownConversation,
    Normalized,
    conversation_id,
    extends,
    find_conversation,
)

MAX_CREDENTIALS: Final = 64  # credentials remembered (least recently used dropped first)
MAX_PER_CREDENTIAL: Final = 256  # conversations remembered per credential
ANONYMOUS: Final = "anon"  # the scope of requests that carry no credential at all
_CREDENTIAL_HEADERS: Final = (b"authorization", b"x-api-key")


def credential_of(headers: Mapping[bytes, bytes]) -> str:
    """The credential scope of a request: a digest of its `Authorization` (else `x-api-key`) value. With the
    operator's token configured the proxy runs every client in the operator's scope instead (`Proxy.scope`):
    they all hold that one credential."""
    for name in _CREDENTIAL_HEADERS:
        value = headers.get(name)
        if value:
            return "k" + xxhash.xxh3_128_hexdigest(name + b"\0" + value)[:32]
    return ANONYMOUS


@dataclass(frozen=True, kw_only=True)
class Entry:
    known: KnownConversation
    model: str  # the model label of its KV's identity (a donor must have the same)
    tools: bool  # its last request declared tools


def common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ConversationTable:
    def __init__(self, *, max_credentials: int = MAX_CREDENTIALS, per_credential: int = MAX_PER_CREDENTIAL):
        self.max_credentials, self.per_credential = max_credentials, per_credential
        self._by_cred: OrderedDict[str, OrderedDict[str, Entry]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_cred.values())

    def _recent(self, credential: str) -> list[Entry]:
        """Most recent first."""
        return list(reversed(self._by_cred.get(credential, {}).values()))

    def get(self, credential: str, session_id: str) -> Entry | None:
        table = self._by_cred.get(credential)
        return table.get(session_id) if table is not None else None

    def known_extension(
        self,
        credential: str,
        session_id: str | None,
        request: Normalized | None,
        *,
        new: bool,
        diverged: int | None,
    ) -> bool:
        """Does `request` carry every element of its session's last request, exactly (the last one too), then
        perhaps more? What the scope gate (coordinator/scope.py) needs to know that its prompt keeps the
        session's KV: a new session, a divergence, a cut or rewritten last message, or a route without
        messages (`/completion`, `/infill`) is not known to."""
        entry = self.get(credential, session_id) if session_id is not None else None
        if entry is None or request is None or new or diverged is not None:
            return False
        match = extends(request, entry.known)
        return match is not None and match.exact

    def identify(self, credential: str, request: Normalized) -> tuple[str, bool]:
        """(conversation id, continued): the known conversation the request extends, or a new id."""
        match = find_conversation(request, credential, (e.known for e in self._recent(credential)))
        if match is not None:
            return match.conversation_id, True
        return conversation_id(credential, request, self._by_cred.get(credential, {})), False

    def donor(
        self, credential: str, request: Normalized, *, model: str, exclude: str
    ) -> tuple[str, int] | None:
        """(session id, leading elements shared) of the conversation of this credential and model that
        shares the most leading elements with `request` (at least one); ties: the most recent."""
        best: tuple[str, int] | None = None
        for entry in self._recent(credential):
            if entry.model != model or entry.known.conversation_id == exclude:
                continue
            n = common_prefix(entry.known.digests, request.digests)
            if n > 0 and (best is None or n > best[1]):
                best = (entry.known.conversation_id, n)
        return best

    def record(self, credential: str, session_id: str, model: str, request: Normalized) -> None:
        """After a successful answer: `request` is the conversation's latest."""
        table = self._by_cred.get(credential)
        if table is None:
            table = self._by_cred[credential] = OrderedDict()
        self._by_cred.move_to_end(credential)
        table[session_id] = Entry(
            known=KnownConversation.of(session_id, credential, request),
            model=model,
            tools=bool(request.roles) and request.roles[0] == "tools",
        )
        table.move_to_end(session_id)
        while len(table) > self.per_credential:
            table.popitem(last=False)
        while len(self._by_cred) > self.max_credentials:
            self._by_cred.popitem(last=False)
