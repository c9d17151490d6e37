"""The audit log (`--audit-log=PATH`): one JSON line per call that changes or reveals the server's control state,
and per refused call of any group.

What is written, decided here and nowhere else:

- every call to the model-repository, shared-memory, logging and trace groups, when it ends, with its outcome;
- every call of any group that admission refused (a restricted API without its header, a missing or bad bearer
  token, a token without the group's scope, a call refused while the server shuts down), flagged `"refused"`.

Each line: `time` (ISO 8601, UTC), `protocol` (http, grpc, in_process), `peer` (the client's address as the
frontend saw it), `identity` (the token's subject or the client certificate's; null when nothing verified one),
`group` (Triton's API group), `action` (the service operation: load_model, register_shared_memory, infer, ...),
`model` (empty when the call names none), `region` (shared-memory calls), `outcome` (OK, or the neutral status
code name of geserve.errors: UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARG, ...) and, for a failure, `message`.

How a call's end is seen, with no hook in any frontend: the service admits each call first; a refusal is
recorded right there (`InferenceService.admit`). Operations of every group but inference run their body inside
`InferenceService._call(...)`, whose context manager reports the end, with the exception if one left the body,
to `finished` here, which writes only for the audited groups. So the rule (which groups, which fields) lives in
this module, and the service has one place where a call starts and one where it ends; frontends change nothing.
Inference itself never reaches `finished` (its refusals are recorded, its successes would flood the file).

Nothing secret is ever written: no header, no token, no key, no request body; messages are geserve's own (the
authentication policy words its refusals itself, never echoing what it was sent).

The file is opened for appending (mode 0600 when created). Before each write the path is checked against the
open file (device and inode): after a rotation (the file renamed or removed) a new file is created at the path,
so logrotate needs no signal and no `copytruncate`; a truncated file is appended to at its new end. Writes are a
single `os.write` of one line, under a lock (calls from other threads, the in-process API, stay whole).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from geserve.errors import GeserveError
from geserve.service.context import ApiGroup, CallContext

logger = logging.getLogger(__name__)

# The groups whose every call is recorded; refusals are recorded for every group.
AUDITED_GROUPS = frozenset({ApiGroup.MODEL_REPOSITORY, ApiGroup.SHARED_MEMORY, ApiGroup.LOGGING, ApiGroup.TRACE})


class AuditLog:
    """Appends JSON lines to one file, following it across rotations."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd = -1
        self._identity: tuple[int, int] | None = None
        self._failed = False  # a failing write is logged once, not per call
        self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        stat = os.fstat(fd)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._identity = fd, (stat.st_dev, stat.st_ino)

    def _follow_rotation(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._open()
            return
        if (stat.st_dev, stat.st_ino) != self._identity:
            self._open()

    def refused(
        self, group: ApiGroup, action: str, model: str, context: CallContext, error: BaseException, region: str = ""
    ) -> None:
        """Admission refused the call (any group)."""
        self._write(group, action, model, region, context, error, refused=True)

    def finished(
        self, group: ApiGroup, action: str, model: str, context: CallContext, error: BaseException | None,
        region: str = "",
    ) -> None:
        """An admitted call ended, with `error` if it failed; recorded for the audited groups only."""
        if group in AUDITED_GROUPS:
            self._write(group, action, model, region, context, error, refused=False)

    def _write(
        self, group: ApiGroup, action: str, model: str, region: str, context: CallContext,
        error: BaseException | None, refused: bool,
    ) -> None:
        record: dict[str, Any] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "protocol": context.transport.value,
            "peer": context.peer,
            "identity": context.caller,
            "group": group.value,
            "action": action,
            "model": model,
        }
        if group is ApiGroup.SHARED_MEMORY:
            record["region"] = region
        record["outcome"] = _outcome(error)
        if error is not None:
            # geserve's own words only: anything else might carry what a client sent
            record["message"] = error.message if isinstance(error, GeserveError) else "internal error"
        if refused:
            record["refused"] = True
        line = orjson.dumps(record) + b"\n"
        with self._lock:
            try:
                self._follow_rotation()
                os.write(self._fd, line)
                self._failed = False
            except OSError as exc:
                if not self._failed:
                    logger.error("cannot write the audit log %s: %s", self.path, exc.strerror)
                self._failed = True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "OK"
    return error.code.value if isinstance(error, GeserveError) else "INTERNAL"
