"""kvmove as an SGLang prefill/decode transfer backend (SGLang 0.5.23).

``pip install kvmove`` puts a plugin entry point in the group
``sglang.srt.plugins`` (:func:`kvmove.sglang.plugin.register`): every SGLang
process that loads plugins (the launcher, the schedulers, the DP controller,
the detokenizer) then accepts ``--disaggregation-transfer-backend kvmove``
and :func:`sglang.srt.disaggregation.utils.get_kv_class` answers the classes
of :mod:`kvmove.sglang.conn` for it. With ``SGLANG_PLUGINS`` set (an
allowlist), it must name ``kvmove``.

What differs from SGLang's Mooncake backend (see :mod:`kvmove.sglang.conn`):

- The decode's pre-allocation is a kvmove grant (a handoff session, rules 12
  and 13 of kvmove's contract): the decode's ``send_metadata`` grants the
  prefill rank the pages it allocated, and the session's deadline starts
  there. Before the grant, a prefill request waits in ``Bootstrapping`` with
  no timer (SGLang's bootstrap timeout, counted from the request's arrival,
  is not used).
- ``poll()`` answers from the session's state, which both ends agree on:
  ``WaitingForInput`` once granted, ``Transferring`` while written,
  ``Success`` only once the decode found every byte landed, ``Failed`` once
  the session failed, expired or was cancelled.
- Failures raise SGLang's ``KVTransferError`` with kvmove's error (its kind
  and whether it is transient) in the message and in ``kvmove_error``.

Supported layouts today: the same attention TP size on both sides, no
context parallelism; a prefill with pipeline stages gets one session per
stage and the decode's verdict on the whole request (see
:mod:`kvmove.sglang.conn`). Other layouts fail each request at once with a
message that says so.
"""

BACKEND_NAME = "kvmove"

__all__ = ["BACKEND_NAME"]
