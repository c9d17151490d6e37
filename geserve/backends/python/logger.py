"""`pb_utils.Logger`: a model's log lines go to geserve's own log, naming the model file and line."""

from __future__ import annotations

import enum
import logging

_logger = logging.getLogger("geserve.python_model")


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_LEVELS = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


class Logger:
    """Used as `pb_utils.Logger.log_info(...)` or through an instance; both work."""

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        _logger.log(_LEVELS.get(LogLevel(level), logging.INFO), "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        _logger.info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        _logger.warning("%s", message, stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        _logger.error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        _logger.debug("%s", message, stacklevel=2)
