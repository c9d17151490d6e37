"""Log settings a client reads and changes at run time (Triton's logging extension; tracing is service/tracing/)."""

from __future__ import annotations

import logging

from geserve.errors import InvalidArgumentError, UnsupportedError

LogValue = bool | int | str

_LOG_TYPES: dict[str, type] = {
    "log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int,
    "log_format": str,
}
_TYPE_NAMES = {bool: "boolean", int: "int32", str: "string"}
_LOG_FORMATS = ("default", "ISO8601")


class LogSettings:
    """The server's log switches; a change takes effect on the `geserve` logger at once."""

    def __init__(self, verbose_level: int = 0, info: bool = True) -> None:
        self._values: dict[str, LogValue] = {
            "log_file": "", "log_info": info, "log_warning": True, "log_error": True,
            "log_verbose_level": verbose_level, "log_format": "default",
        }

    def get(self) -> dict[str, LogValue]:
        return dict(self._values)

    def update(self, changes: dict[str, LogValue]) -> dict[str, LogValue]:
        """Validate every change first (Triton's messages), then apply them all; unknown keys are ignored."""
        accepted: dict[str, LogValue] = {}
        for key, value in changes.items():
            expected = _LOG_TYPES.get(key)
            if expected is None:
                continue
            if type(value) is not expected or (isinstance(value, int) and value < 0):
                raise InvalidArgumentError(f"expect {_TYPE_NAMES[expected]} for '{key}'")
            if key == "log_format" and value not in _LOG_FORMATS:
                raise InvalidArgumentError(f"invalid argument for log_format, got: {value}")
            if key == "log_file" and value != self._values["log_file"]:
                raise UnsupportedError("log_file cannot be changed at run time: geserve logs to its standard error")
            accepted[key] = value
        self._values.update(accepted)
        logging.getLogger("geserve").setLevel(self._level())
        return self.get()

    def _level(self) -> int:
        values = self._values
        if values["log_verbose_level"]:
            return logging.DEBUG
        if values["log_info"]:
            return logging.INFO
        if values["log_warning"]:
            return logging.WARNING
        return logging.ERROR if values["log_error"] else logging.CRITICAL + 1
