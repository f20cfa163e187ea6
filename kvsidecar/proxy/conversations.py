"""The proxy's table of known conversations (issue 28): digests of each conversation's latest request, per
credential, bounded, in memory only.

Three uses (docs/CLIENTS.md):

- *content identity*: a request that names no session continues the conversation of its credential whose
  messages it extends (`kvsidecar.proxy.client_content`), else starts a new one (`c:<digest>`);
- *divergence*: a turn of a known session whose messages do not extend its last request is reported
  (`PROMPT_DIVERGED`, the message index), and run as auxiliary when it is a side request (much shorter,
  without the tools, or `from_elsewhere`: its message 0 is not the conversation's and it does not carry the
  conversation after it: a title or summary that a client sent under the conversation's id); such a
  request is remembered (`aside`), and a request that continues it is where the conversation went
  (`promoted`);
- *prefix donor*: a new session starts from the snapshot of the conversation of the same credential and
  model that shares the most leading elements with it (the acquire's `prefix_from`).

A turn is known from its dispatch (`begin`), before the client can see the end of its answer, so that a
client that sends its next turn the instant it reads that end continues its conversation; the request
before it stays known until the turn ends (`end`: answered, it is settled; an error restores the one
before; an abort keeps both: the slot holds the aborted prompt and the answer so far).

Nothing here holds a prompt's text: only xxh3 digests of its normalized elements. The credential is a
digest of the client's `Authorization` / `x-api-key` value: conversations of one credential never match,
continue or donate to another's. A wrong guess costs warmth, never correctness: an id only names which KV
to start from, and llama-server reuses only the token-exact common prefix of what its slot holds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
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
MAX_SIDES: Final = 1024  # side requests remembered (for `promoted`), all credentials together
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
class Shape:
    """What a conversation's latest request looked like, beyond its digests: the byte lengths of its
    message 0 (its first element that is not the tools) and of its last element, so that a later request
    can be told to have grown one of them in place (the old bytes are its prefix: one digest of that
    prefix says so) rather than rewritten it."""

    head: int | None  # the index of message 0 (None: no message)
    head_len: int
    last_len: int

    @classmethod
    def of(cls, request: Normalized) -> Shape:
        head = first_message(request)
        return cls(
            head=head,
            head_len=len(request.elements[head]) if head is not None else 0,
            last_len=len(request.elements[-1]) if request.elements else 0,
        )


@dataclass(frozen=True, kw_only=True)
class Entry:
    known: KnownConversation  # its latest request: the turn in flight, or the last one that ran
    shape: Shape
    model: str  # the model label of its KV's identity (a donor must have the same)
    tools: bool  # its last request declared tools
    turn: int  # the serial of the turn that recorded `known` (`begin`)
    # while a turn is in flight (or after one the client aborted): the request before it, which a request
    # of the same conversation may still extend (a retry of it, or an edit of the turn in flight)
    settled: Entry | None = None

    def continued_by(self, request: Normalized) -> bool:
        """Does `request` continue the conversation: its latest request, or the one before a turn in flight
        (or aborted)?"""
        if continues(request, self.known, self.shape):
            return True
        return self.settled is not None and continues(request, self.settled.known, self.settled.shape)


def element_digest(element: bytes) -> str:
    """The digest `kvsidecar.proxy.client_content` gives an element (xxh3-64 of its bytes)."""
    return xxhash.xxh3_64_hexdigest(element)


def first_message(request: Normalized) -> int | None:
    """The index of the request's message 0: its first element that is not the tools."""
    return next((i for i, role in enumerate(request.roles) if role != "tools"), None)


def grew(element: bytes, length: int, digest: str) -> bool:
    """`element` is the element of `length` bytes and `digest`, grown in place (those bytes its prefix)."""
    return len(element) > length and element_digest(element[:length]) == digest


def continues(request: Normalized, known: KnownConversation, shape: Shape) -> bool:
    """`request` extends `known` (`client_content.extends`), or carries its elements with the last one grown
    in place (a prompt that grows within its last message)."""
    if extends(request, known) is not None:
        return True
    n = len(known.digests)
    return (
        n > 0
        and len(request.digests) == n
        and request.digests[: n - 1] == known.digests[: n - 1]
        and grew(request.elements[n - 1], shape.last_len, known.digests[n - 1])
    )


def from_elsewhere(request: Normalized, known: KnownConversation, shape: Shape) -> bool:
    """Is `request` another conversation's, though under this one's id: its message 0 differs from the
    conversation's (other than by growing in place), and it does not carry the conversation's messages
    after message 0 with more after them? A title or summary request carries at most a piece of the
    conversation; a turn whose system prompt changed (a date, a model name in it) carries all of it, then
    the new turn. A conversation of one message (a raw completion's prompt) can only grow in place."""
    if shape.head is None:
        return False
    mine = first_message(request)
    if mine is None:
        return True
    theirs = known.digests[shape.head]
    if request.digests[mine] == theirs or grew(request.elements[mine], shape.head_len, theirs):
        return False
    rest = known.digests[shape.head + 1 :]
    carried = request.digests[mine + 1 : mine + 1 + len(rest)]
    return not (rest and carried == rest and len(request.digests) - mine > len(known.digests) - shape.head)


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
        # the latest request under a conversation's id that ran beside it (auxiliary): if the client's next
        # request extends it, the conversation itself has moved there (`promoted`)
        self._sides: OrderedDict[tuple[str, str], tuple[KnownConversation, Shape]] = OrderedDict()
        self._turns = itertools.count(1)

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
        """(conversation id, continued): the known conversation the request extends (its latest request, or
        the one before a turn still in flight), or a new id."""
        known = [k for e in self._recent(credential) for k in (e.known, e.settled and e.settled.known) if k]
        match = find_conversation(request, credential, known)
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

    def begin(self, credential: str, session_id: str, model: str, request: Normalized) -> int:
        """A turn of the conversation is dispatched: `request` is its latest from now on, before the client
        can see the end of its answer (the request before it stays known until the turn ends). Returns the
        turn's serial, for `end`."""
        table = self._by_cred.get(credential)
        if table is None:
            table = self._by_cred[credential] = OrderedDict()
        self._by_cred.move_to_end(credential)
        before = table.get(session_id)
        turn = next(self._turns)
        table[session_id] = Entry(
            known=KnownConversation.of(session_id, credential, request),
            shape=Shape.of(request),
            model=model,
            tools=bool(request.roles) and request.roles[0] == "tools",
            turn=turn,
            settled=replace(before, settled=None) if before is not None else None,
        )
        self._sides.pop((credential, session_id), None)
        table.move_to_end(session_id)
        while len(table) > self.per_credential:
            table.popitem(last=False)
        while len(self._by_cred) > self.max_credentials:
            self._by_cred.popitem(last=False)
        return turn

    def end(self, credential: str, session_id: str, turn: int, status: str) -> None:
        """The turn `begin` numbered has ended: `ok`, its request stays the latest; `error` (llama-server
        refused it or failed), the conversation is what it was before; `aborted` (the client left), its
        request stays the latest (the slot holds it and the answer so far) and the one before stays known."""
        table = self._by_cred.get(credential)
        entry = table.get(session_id) if table is not None else None
        if table is None or entry is None or entry.turn != turn or status == "aborted":
            return  # a later turn of it recorded since, or forgotten: nothing of this one to settle
        if status == "ok":
            table[session_id] = replace(entry, settled=None)
        elif entry.settled is not None:
            table[session_id] = entry.settled
        else:
            del table[session_id]

    def record(self, credential: str, session_id: str, model: str, request: Normalized) -> None:
        """`request` is the conversation's latest (a turn that began and ended)."""
        self.end(credential, session_id, self.begin(credential, session_id, model, request), "ok")

    def aside(self, credential: str, session_id: str, request: Normalized) -> None:
        """`request` ran beside the conversation under its id (auxiliary)."""
        self._sides[credential, session_id] = (
            KnownConversation.of(session_id, credential, request),
            Shape.of(request),
        )
        self._sides.move_to_end((credential, session_id))
        while len(self._sides) > MAX_SIDES:
            self._sides.popitem(last=False)

    def promoted(self, credential: str, session_id: str, request: Normalized) -> bool:
        """Does `request` continue (with more: not a retry) the latest request that ran beside the
        conversation under its id? Then that is where the conversation went: its message 0 changed for
        good, or it was compacted, or its first request looked like a side request."""
        side = self._sides.get((credential, session_id))
        if side is None or not request.elements:
            return False
        known, shape = side
        more = len(request.digests) > len(known.digests) or len(request.elements[-1]) > shape.last_len
        return more and continues(request, known, shape)
