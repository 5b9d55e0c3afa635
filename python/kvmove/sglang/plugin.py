"""The SGLang plugin: makes ``kvmove`` a transfer backend name.

SGLang (0.5.23) turns ``--disaggregation-transfer-backend`` into the enum
``TransferBackend`` in the launcher, each scheduler and each tokenizer
worker, and picks the classes with ``get_kv_class``, an if/elif over that
enum. :func:`register` (the entry point ``kvmove`` of the group
``sglang.srt.plugins``) therefore

1. adds ``kvmove`` to the choices of the command-line flag
   (``add_disagg_transfer_backend_choices``, SGLang's own hook for this);
2. adds the member ``TransferBackend.KVMOVE`` to the enum, in place, so
   every module that already imported the enum sees it;
3. wraps ``get_kv_class`` (an AROUND hook of SGLang's hook registry, which
   also rebinds the copies other modules imported) to answer the classes of
   :mod:`kvmove.sglang.conn` for ``KVMOVE`` and SGLang's own otherwise.

Calling it again does nothing more.
"""

from __future__ import annotations

import logging

from . import BACKEND_NAME

logger = logging.getLogger(__name__)

_MEMBER = "KVMOVE"
_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def _extend_enum(enum_cls) -> None:
    """Adds ``KVMOVE = "kvmove"`` to the enum ``enum_cls`` in place."""
    if BACKEND_NAME in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_ = _MEMBER
    member._value_ = BACKEND_NAME
    member.__objclass__ = enum_cls
    member.__init__(BACKEND_NAME)
    # EnumType.__setattr__ refuses to rebind members; the class dict is
    # written directly, as the enum machinery does when it builds a class.
    type.__setattr__(enum_cls, _MEMBER, member)
    enum_cls._member_map_[_MEMBER] = member
    enum_cls._value2member_map_[BACKEND_NAME] = member
    enum_cls._member_names_.append(_MEMBER)


def _around_get_kv_class(orig, transfer_backend, class_type):
    from sglang.srt.disaggregation import utils as du

    if transfer_backend is not getattr(du.TransferBackend, _MEMBER, None):
        return orig(transfer_backend, class_type)
    if class_type == du.KVClassType.KVARGS:
        # Every backend shares SGLang's KVArgs.
        return orig(du.TransferBackend.FAKE, class_type)
    from . import conn

    return {
        du.KVClassType.MANAGER: conn.KvmoveKVManager,
        du.KVClassType.SENDER: conn.KvmoveKVSender,
        du.KVClassType.RECEIVER: conn.KvmoveKVReceiver,
        du.KVClassType.BOOTSTRAP_SERVER: conn.KvmoveKVBootstrapServer,
    }.get(class_type)


_around_get_kv_class.kvmove = True  # how register() knows it hooked already


def register() -> None:
    """Entry point of the SGLang plugin (see the module's doc)."""
    from sglang.srt.server_args import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])

    from sglang.srt.disaggregation import utils as du

    _extend_enum(du.TransferBackend)

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(getattr(h, "kvmove", False) for h in _registered_hooks(HookRegistry)):
        HookRegistry.register(_TARGET, _around_get_kv_class, HookType.AROUND)
        if not _inside_load_plugins():
            # load_plugins() applies every plugin's hooks once all ran
            # (applying them here would leave the hooks of plugins loaded
            # after this one on the same targets unapplied); called alone,
            # register() applies them itself.
            HookRegistry.apply_hooks()
    logger.debug("kvmove: registered as SGLang transfer backend %r", BACKEND_NAME)


def _inside_load_plugins() -> bool:
    """Whether SGLang's load_plugins() is running this entry point (it
    sets the plugin being loaded in a context variable)."""
    try:
        from sglang.srt.plugins.hook_registry import _current_plugin_source
    except ImportError:
        return False
    return _current_plugin_source.get() is not None


def _registered_hooks(registry):
    """The hooks registered for ``get_kv_class`` so far (the registry keeps
    ``(type, hook, source)`` tuples per target)."""
    hooks = getattr(registry, "_hooks", None)
    if not isinstance(hooks, dict):
        return []
    return [entry[1] for entry in hooks.get(_TARGET, []) if isinstance(entry, tuple) and len(entry) > 1]
