"""Fingerprint records: the components of every runtime fingerprint a snapshot was saved under.

It owns `<state_dir>/fingerprints/<digest>.json`. A manifest records only a fingerprint's digest; these
files let a later mismatch say what changed (`RuntimeFingerprint.mismatch_reason`). They are best effort:
a record that is missing, not a plain file of ours, or not a flat map of strings under the caps reads as
unknown, which only makes the reason less specific, never lets a restore through; the next registration
of that fingerprint writes the record again.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat

from kvsidecar.errors import KvError
from kvsidecar.files.atomic import atomic_write_at
from kvsidecar.files.confined import ConfinedDir, read_capped
from kvsidecar.files.documents import FINGERPRINT_RECORD, DocumentError
from kvsidecar.fingerprint.runtime import RuntimeFingerprint

_MAX_BYTES = FINGERPRINT_RECORD.max_bytes
_MAX_ENTRIES = 4096


class FingerprintRecords:
    def __init__(self, directory: ConfinedDir) -> None:
        self.directory = directory

    def register(self, fingerprint: RuntimeFingerprint) -> None:
        """Remember a fingerprint's components, so a later mismatch can say what changed. Best effort."""
        name = f"{fingerprint.digest}.json"
        with contextlib.suppress(KvError, OSError):
            st = self.directory.lstat(name)
            ours = st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1
            if ours and self.components(fingerprint.digest) == fingerprint.components:
                return  # a record that does not read back as these components is written again
            payload = json.dumps(fingerprint.components, sort_keys=True).encode()
            self.directory.anchor.ensure()  # only into the held directory, while its path leads there
            with self.directory.fd() as dfd:
                atomic_write_at(dfd, self.directory.check(name), payload)

    def components(self, digest: str) -> dict[str, str] | None:
        """The components a fingerprint was registered with; None if unknown or the file is not sane."""
        try:
            with self.directory.open_file(f"{digest}.json", uids=frozenset({os.geteuid()})) as (fd, _):
                raw = read_capped(fd, _MAX_BYTES)
            data = FINGERPRINT_RECORD.read(raw)
        except (KvError, OSError, DocumentError):
            return None
        if not isinstance(data, dict) or len(data) > _MAX_ENTRIES:
            return None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            return None
        return dict(data)
