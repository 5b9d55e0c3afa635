"""Loaded by the vLLM servers of pd_check.py (on their PYTHONPATH): gives
logger ``kvmove`` a handler that names it, so the check can tell kvmove's
warnings and errors from vLLM's in the servers' logs."""

import logging
import sys

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("[kvmove %(levelname)s] %(name)s: %(message)s"))
_logger = logging.getLogger("kvmove")
_logger.addHandler(_handler)
_logger.setLevel(logging.INFO)
_logger.propagate = False
