"""kvmove's native KV connector for vLLM (v1 connector API, vLLM 0.32).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvmoveConnector",
                           "kv_connector_module_path": "kvmove.vllm",
                           "kv_role": "kv_producer", "kv_port": 14600,
                           "kv_load_failure_policy": "recompute"}'

and send requests through the router (``python -m kvmove.vllm.proxy``),
which gives the prefill and the decode one handoff id and each other's
kvmove address. See :mod:`kvmove.vllm.connector` for what happens.

Importing this module is cheap (vLLM's API server imports it): the engine
starts in the workers only. The connector's classes load on first use, so the router
(``python -m kvmove.vllm.proxy``) runs without importing vLLM at all.
"""

__all__ = ["KvmoveConnector", "KvmoveConnectorMetadata", "KvmoveWorkerMetadata"]


def __getattr__(name):
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
