"""``nixl.logging`` served by kvmove: ``get_logger(name)``, a logger under
``"nixl"`` as NIXL's module gives (``"_api"`` becomes ``"nixl.api"``).
The first call sets the ``"nixl"`` logger up as NIXL's does: INFO and up
to standard output, not passed on to the root logger, the level from
``NIXL_LOG_LEVEL`` when it is set (``TRACE``, ``DEBUG``, ``INFO``,
``WARN``, ``ERROR``, ``FATAL``). kvmove's own agent logs on
``"kvmove.nixl"``."""

import logging
import os
import sys

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}

_set_up = False


def set_log_level_by_env(nixl_logger: logging.Logger) -> None:
    """Sets ``nixl_logger``'s level from ``NIXL_LOG_LEVEL``, if set; an
    unknown level is logged as a warning and changes nothing."""
    name = os.environ.get("NIXL_LOG_LEVEL")
    if not name:
        return
    level = _LEVELS.get(name.upper())
    if level is None:
        nixl_logger.warning("NIXL_LOG_LEVEL=%r is not one of %s: level unchanged", name, ", ".join(_LEVELS))
        return
    nixl_logger.setLevel(level)


def setup_logging() -> None:
    """Sets the ``"nixl"`` logger up (once; later calls do nothing)."""
    global _set_up
    if _set_up:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s NIXL %(levelname)s %(name)s: %(message)s"))
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.setLevel(logging.INFO)
    nixl_logger.addHandler(handler)
    nixl_logger.propagate = False
    set_log_level_by_env(nixl_logger)
    _set_up = True


def get_logger(name: str) -> logging.Logger:
    """The logger ``"nixl.<name>"`` (leading underscores dropped), with the
    ``"nixl"`` logger set up."""
    setup_logging()
    return logging.getLogger("nixl." + name.lstrip("_"))
