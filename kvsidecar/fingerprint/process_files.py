"""Files as the llama-server process sees them: a path it was given, resolved against its working
directory and root (a server in a container or chroot names paths of its own), and the digest of the file
there, or a stable word for why there is none (`unresolved`, `unreadable`, `absent`). The fingerprint's
settings, libraries and config files, and the model proof, all read files through this one view."""

from __future__ import annotations

import os

from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import ProcessInfo


class ProcessFiles:
    """Digests (or a stable word for why there is none) of paths as the llama-server process sees them.
    `digests` None: nothing is read (the model proof only resolves paths); `process` None: a remote
    server, whose paths are read as they are here."""

    def __init__(self, digests: FileDigestCache | None, process: ProcessInfo | None) -> None:
        self.digests, self.process = digests, process

    def local(self, path: str) -> str | None:
        p = self.process
        if not os.path.isabs(path):
            if p is None or p.cwd is None:
                return None
            path = os.path.join(p.cwd, path)
        return (p.root + path) if p is not None and p.root else path

    def state(self, path: str | None, *, ours: bool = False) -> str:
        """`ours`: a path in this process' view already (/proc/<pid>/exe), not in the server's."""
        if self.digests is None or not path:
            return ""
        local = path if ours else self.local(path)
        if local is None:
            return "unresolved"
        digest = self.digests.digest(local)
        if digest is not None:
            return digest
        return "unreadable" if os.path.lexists(local) else "absent"
