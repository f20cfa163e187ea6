"""The one exception tree of kvsidecar, its stable codes (spec §79) and their HTTP statuses.

    KvError                         root: every error we raise carries .code, .message, .hint
    ├── BackendError                the llama-server side (converted from httpx inside the backend only)
    │   ├── BackendUnavailable      KV_BACKEND_UNAVAILABLE   connect refused, DNS, 5xx, bad JSON
    │   │   └── ConnectionLost      KV_BACKEND_UNAVAILABLE   the server dropped a request it had taken
    │   ├── BackendUnsupported      KV_BACKEND_UNSUPPORTED   /slots disabled, no --slot-save-path
    │   ├── OperationTimeout        KV_OPERATION_TIMEOUT     a persistence call ran past its bound
    │   ├── SlotNotFound            KV_SLOT_NOT_FOUND        slot id not in GET /slots
    │   ├── SaveFailed              KV_SAVE_FAILED
    │   ├── RestoreFailed           KV_RESTORE_FAILED
    │   └── EraseFailed             KV_ERASE_FAILED
    ├── SnapshotError               a snapshot file or its manifest
    │   ├── SnapshotNotFound        KV_SNAPSHOT_NOT_FOUND
    │   ├── SnapshotIncompatible    KV_SNAPSHOT_INCOMPATIBLE (fingerprint differs)
    │   ├── SnapshotCorrupt         KV_SNAPSHOT_CORRUPT      size, header or checksum mismatch
    │   ├── ManifestInvalid         KV_MANIFEST_INVALID
    │   └── MetadataIO              KV_METADATA_IO
    │       └── DirMoved            KV_SNAPSHOT_DIR_MOVED    a path no longer leads to the directory held
    ├── RequestError                what a client sent us
    │   ├── BadRequest              KV_BAD_REQUEST
    │   ├── InvalidSessionId        KV_INVALID_SESSION_ID
    │   ├── LeaseNotFound           KV_LEASE_NOT_FOUND
    │   ├── Unauthorized            KV_UNAUTHORIZED
    │   ├── PayloadTooLarge         KV_PAYLOAD_TOO_LARGE
    │   ├── NotFound                KV_NOT_FOUND             no such route, session
    │   ├── MethodNotAllowed        KV_METHOD_NOT_ALLOWED    a route that does not take this method
    │   ├── ProxyForbidden          KV_PROXY_FORBIDDEN       a route the proxy does not forward
    │   ├── BodyLimit               KV_BODY_LIMIT            a body over what llama-server parses safely
    │   ├── ModalityUnsupported     KV_MODALITY_UNSUPPORTED  an image/audio/video part the model cannot take
    │   ├── RequestTimeout          KV_REQUEST_TIMEOUT       a request head not complete in time
    │   └── HeadersTooLarge         KV_HEADERS_TOO_LARGE     a request head over the listener's limits
    ├── TooManyConnections          KV_TOO_MANY_CONNECTIONS  a listener at max_connections, all busy
    ├── TooManyBodies               KV_TOO_MANY_BODIES       one credential's slow bodies at their cap
    ├── SlotBusy                    KV_SLOT_BUSY
    │   └── ModelBusy               KV_MODEL_BUSY            no room on a router for its model in time
    ├── ShuttingDown                KV_SHUTTING_DOWN         SIGTERM while a request waited
    ├── SlotStateInvalid            KV_SLOT_STATE_INVALID
    ├── ConfigError                 KV_CONFIG_INVALID
    ├── ConfigExists                KV_CONFIG_EXISTS         `config init` would overwrite a file
    ├── ListenInUse                 KV_LISTEN_IN_USE         `serve`: a listen address is taken
    ├── UnitPathUnsafe              KV_UNIT_PATH_UNSAFE      `install-systemd`: a path the units hide
    ├── StateLocked                 KV_STATE_LOCKED          another daemon holds the state_dir
    └── InvariantViolation          KV_INVARIANT

`HTTP_STATUS` is the only place that maps a code to an HTTP status.
"""

from __future__ import annotations

from typing import ClassVar


class KvError(Exception):
    """Root of every error kvsidecar raises on purpose."""

    code: ClassVar[str] = "KV_ERROR"
    default_hint: ClassVar[str] = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "hint": self.hint}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BackendError(KvError):
    code = "KV_BACKEND_ERROR"


class BackendUnavailable(BackendError):
    code = "KV_BACKEND_UNAVAILABLE"
    default_hint = "Is llama-server running and reachable at the configured base_url?"


class ConnectionLost(BackendUnavailable):
    """The server accepted the request and the connection died before the answer (it crashed)."""


class BackendUnsupported(BackendError):
    code = "KV_BACKEND_UNSUPPORTED"
    default_hint = (
        "Start llama-server with --slots and --slot-save-path pointing at kvsidecar's snapshot_dir."
    )


class OperationTimeout(BackendError):
    code = "KV_OPERATION_TIMEOUT"
    default_hint = "Raise backend.persist_timeout_s, or check the disk under --slot-save-path."


class SlotNotFound(BackendError):
    code = "KV_SLOT_NOT_FOUND"
    default_hint = "The slot id is not one llama-server reports in GET /slots; check --parallel and the mode."


class SaveFailed(BackendError):
    code = "KV_SAVE_FAILED"
    default_hint = "Check free disk space and permissions of --slot-save-path."


class RestoreFailed(BackendError):
    code = "KV_RESTORE_FAILED"
    default_hint = (
        "The snapshot does not fit this server (model, cache type, context); it will be recomputed."
    )


class EraseFailed(BackendError):
    code = "KV_ERASE_FAILED"


class SnapshotError(KvError):
    code = "KV_SNAPSHOT_ERROR"


class SnapshotNotFound(SnapshotError):
    code = "KV_SNAPSHOT_NOT_FOUND"


class SnapshotIncompatible(SnapshotError):
    code = "KV_SNAPSHOT_INCOMPATIBLE"
    default_hint = (
        "The server's model or KV layout changed since this snapshot was saved; it will be recomputed."
    )


class SnapshotCorrupt(SnapshotError):
    code = "KV_SNAPSHOT_CORRUPT"
    default_hint = "The file was truncated or modified on disk; it will not be restored."


class ManifestInvalid(SnapshotError):
    code = "KV_MANIFEST_INVALID"


class MetadataIO(SnapshotError):
    code = "KV_METADATA_IO"
    default_hint = "Check that kvsidecar's state_dir exists, is writable and the disk is not full."


class DirMoved(MetadataIO):
    """A directory kvsidecar holds open (a snapshot directory, manifests/, fingerprints/) is no longer what
    its configured path (or llama-server's --slot-save-path) resolves to: a link retargeted, the directory
    or an ancestor replaced. Nothing is saved, restored or written there until the path leads back."""

    code = "KV_SNAPSHOT_DIR_MOVED"
    default_hint = (
        "Point the path back at the directory kvsidecar started with, or restart kvsidecar and llama-server "
        "with a snapshot_dir / --slot-save-path that name the same real directory."
    )


class Fenced(MetadataIO):
    """Fleet mode: a manifest commit or delete under a fencing token lower than the one the shared store
    has recorded for the session key: another host took the session over; this host's copy is stale."""

    code = "KV_FLEET_FENCED"
    default_hint = "Another host owns this session now; nothing was written. Its next turn is served there."


class RequestError(KvError):
    code = "KV_BAD_REQUEST"


class BadRequest(RequestError):
    code = "KV_BAD_REQUEST"


class InvalidSessionId(RequestError):
    code = "KV_INVALID_SESSION_ID"
    default_hint = "Session ids are 1-128 characters from [A-Za-z0-9._:@+-]."


class LeaseNotFound(RequestError):
    code = "KV_LEASE_NOT_FOUND"
    default_hint = "The lease was already released or it expired (lease_ttl_s)."


class Unauthorized(RequestError):
    code = "KV_UNAUTHORIZED"
    default_hint = "Send 'Authorization: Bearer <token>' with the token from api.token_file."


class PayloadTooLarge(RequestError):
    code = "KV_PAYLOAD_TOO_LARGE"


class NotFound(RequestError):
    code = "KV_NOT_FOUND"


class MethodNotAllowed(RequestError):
    code = "KV_METHOD_NOT_ALLOWED"


class ProxyForbidden(RequestError):
    """A request the proxy refuses to forward: slot management, server settings, or a route llama-server
    would run on a slot kvsidecar cannot choose."""

    code = "KV_PROXY_FORBIDDEN"
    default_hint = (
        "The proxy forwards llama-server's inference routes and read-only information only; slot "
        "management is kvsidecar's own (docs/API.md, Proxy mode)."
    )


class BodyLimit(RequestError):
    """A request body over the limits llama-server is known to parse safely (nesting, values, members of one
    object: `kvsidecar.backend.llama_body`), refused before anything reaches it."""

    code = "KV_BODY_LIMIT"
    default_hint = (
        "The proxy forwards only JSON within the limits llama-server parses safely: nesting depth, values, "
        "members of one object (docs/API.md, Proxy mode)."
    )


class ModalityUnsupported(RequestError):
    """An image, audio or video part for a model llama-server runs without that input (no `--mmproj`)."""

    code = "KV_MODALITY_UNSUPPORTED"
    default_hint = (
        "Send text only, or start llama-server with a multimodal projector (--mmproj) that takes this input."
    )


class RequestTimeout(RequestError):
    code = "KV_REQUEST_TIMEOUT"
    default_hint = "Send the whole request head within header_timeout_s (api/proxy config)."


class HeadersTooLarge(RequestError):
    code = "KV_HEADERS_TOO_LARGE"
    default_hint = (
        "Send at most 64 headers, each line under 8 KiB, 32 KiB of head in all, a target under 8 KiB "
        "(below what llama-server accepts)."
    )


class TooManyBodies(KvError):
    code = "KV_TOO_MANY_BODIES"
    default_hint = (
        "This credential already has max_slow_bodies request bodies arriving slowly; send bodies "
        "whole, or retry after Retry-After seconds."
    )


class TooManyConnections(KvError):
    code = "KV_TOO_MANY_CONNECTIONS"
    default_hint = "Every connection is busy with a request (max_connections); retry later."


class SlotBusy(KvError):
    code = "KV_SLOT_BUSY"
    default_hint = "All slots are leased; retry after Retry-After seconds."


class ModelBusy(SlotBusy):
    """A router's model could not be loaded within `model_wait_s`: every other model of ours the router
    keeps loaded (`--models-max`) had a request in flight the whole time (docs/SWAPS.md)."""

    code = "KV_MODEL_BUSY"
    default_hint = (
        "Every model the router may keep loaded is busy with a request; retry after Retry-After seconds, "
        "or raise the router's --models-max."
    )


class ShuttingDown(KvError):
    code = "KV_SHUTTING_DOWN"
    default_hint = "kvsidecar is stopping; retry after Retry-After seconds (a restarted daemon restores)."


class SlotStateInvalid(KvError):
    code = "KV_SLOT_STATE_INVALID"


class ConfigError(KvError):
    code = "KV_CONFIG_INVALID"


class ConfigExists(KvError):
    code = "KV_CONFIG_EXISTS"
    default_hint = "Pass --force to replace it, or --path to write the defaults elsewhere."


class ListenInUse(KvError):
    """`serve`: another process already listens on a configured address (EADDRINUSE)."""

    code = "KV_LISTEN_IN_USE"
    default_hint = "Stop what listens there (ss -ltnp shows it), or set another port in the config."


class UnitPathUnsafe(KvError):
    """`install-systemd`: a path the units' sandbox would hide (PrivateTmp=, ProtectHome=), or one they
    cannot use (relative, unparseable by systemd, nested, a socket directory that cannot be writable)."""

    code = "KV_UNIT_PATH_UNSAFE"
    default_hint = "Use paths under /var/lib (and binaries under /usr/local), or pass --force."


class StateLocked(KvError):
    """Another daemon holds the state directory's lock (or its lock file cannot be used)."""

    code = "KV_STATE_LOCKED"
    default_hint = "Stop the other daemon first, or give this one another state_dir."


class InvariantViolation(KvError):
    code = "KV_INVARIANT"


HTTP_STATUS: dict[str, int] = {
    BackendUnavailable.code: 502,
    BackendUnsupported.code: 502,
    OperationTimeout.code: 504,
    SlotNotFound.code: 502,
    SaveFailed.code: 502,
    RestoreFailed.code: 502,
    EraseFailed.code: 502,
    SnapshotNotFound.code: 404,
    SnapshotIncompatible.code: 409,
    SnapshotCorrupt.code: 409,
    ManifestInvalid.code: 500,
    MetadataIO.code: 500,
    Fenced.code: 409,
    DirMoved.code: 503,
    BadRequest.code: 400,
    InvalidSessionId.code: 400,
    LeaseNotFound.code: 404,
    Unauthorized.code: 401,
    PayloadTooLarge.code: 413,
    NotFound.code: 404,
    MethodNotAllowed.code: 405,
    ProxyForbidden.code: 403,
    BodyLimit.code: 400,
    ModalityUnsupported.code: 400,
    RequestTimeout.code: 408,
    HeadersTooLarge.code: 431,
    TooManyBodies.code: 429,
    TooManyConnections.code: 503,
    SlotBusy.code: 503,
    ModelBusy.code: 503,
    ShuttingDown.code: 503,
    SlotStateInvalid.code: 409,
    ConfigError.code: 500,
    ConfigExists.code: 409,
    ListenInUse.code: 500,
    UnitPathUnsafe.code: 500,
    StateLocked.code: 503,
    InvariantViolation.code: 500,
}


def http_status(error: KvError) -> int:
    return HTTP_STATUS.get(error.code, 500)
