"""The router for vLLM servers on ``KvmoveConnector``: an OpenAI-compatible
HTTP server that sends each request to a prefill and a decode *at the same
time*, with one handoff id and each side's kvmove address, and answers
with the decode's response (streamed when the client asked for a stream).

    python -m kvmove.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100=127.0.0.1:14600 \\
        --decode  http://127.0.0.1:8200=127.0.0.1:14700

Each ``--prefill`` / ``--decode`` is ``URL=KVHOST:KVPORT``: the server's
HTTP address and its ``kv_port`` (rank 0's kvmove address; rank r listens
on ``KVPORT + r``), with the host its connector listens on (the
``host`` of ``kv_connector_extra_config``). Give several of each: a
request goes to the prefill and the decode with the fewest requests in
flight.

The prefill computes the prompt (``max_tokens`` 1) and pushes its KV as the
decode grants blocks; the decode generates. A prefill that fails leaves the
decode's session to fail, and vLLM's ``kv_load_failure_policy`` decides
(``"recompute"``: the decode computes the prompt itself).

Needs ``aiohttp`` (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
from dataclasses import dataclass

logger = logging.getLogger("kvmove.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Backend:
    url: str
    kv: str
    busy: int = 0


def parse_backend(text: str) -> Backend:
    url, sep, kv = text.rpartition("=")
    host, _, port = kv.rpartition(":")
    if not sep or not url.startswith(("http://", "https://")) or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected URL=KVHOST:KVPORT, got {text!r}")
    return Backend(url.rstrip("/"), kv)


def least_busy(backends: list[Backend]) -> Backend:
    low = min(b.busy for b in backends)
    return random.choice([b for b in backends if b.busy == low])


def prefill_body(body: dict, handoff: int, decode: Backend) -> dict:
    p = dict(body)
    p["stream"] = False
    p.pop("stream_options", None)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["kv_transfer_params"] = {"kvmove": {"role": "send", "handoff": handoff, "peer": decode.kv}}
    return p


def decode_body(body: dict, handoff: int, prefill: Backend) -> dict:
    d = dict(body)
    d["kv_transfer_params"] = {"kvmove": {"role": "recv", "handoff": handoff, "peer": prefill.kv}}
    return d


def make_app(prefills: list[Backend], decodes: list[Backend], timeout: float):
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    async def start(app):
        # A connection per request, never a kept-alive one: a server that
        # was slow or paused (GC, SIGSTOP, a loaded host) closes a kept-alive
        # connection its idle timer expired on even when a request already
        # sits unread in it, and the client sees "Server disconnected" for
        # a request the server never started (a 502 that was not the
        # server's failure). A loopback or LAN connect costs far less than
        # a completion.
        app["http"] = ClientSession(timeout=ClientTimeout(total=timeout), connector=TCPConnector(force_close=True))

    async def stop(app):
        await app["http"].close()

    async def run_prefill(http, p: Backend, body: dict, handoff: int):
        try:
            async with http.post(p.url + body.pop("_route"), json=body) as r:
                text = await r.text()
                if r.status != 200:
                    logger.warning("prefill %s answered %d for handoff %d: %s", p.url, r.status, handoff, text[:300])
        except Exception as e:  # noqa: BLE001 (the decode's session fails; its policy decides)
            logger.warning("prefill %s failed for handoff %d: %s", p.url, handoff, e)
        finally:
            p.busy -= 1

    async def relay(request: web.Request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body is not a JSON object"}}, status=400)
        http = request.app["http"]
        handoff = random.getrandbits(63)
        p, d = least_busy(prefills), least_busy(decodes)
        p.busy += 1
        d.busy += 1
        pre = prefill_body(body, handoff, d)
        pre["_route"] = request.path
        task = asyncio.ensure_future(run_prefill(http, p, pre, handoff))
        request.app["tasks"].add(task)
        task.add_done_callback(request.app["tasks"].discard)
        try:
            async with http.post(d.url + request.path, json=decode_body(body, handoff, p)) as r:
                if not body.get("stream"):
                    data = await r.read()
                    return web.Response(body=data, status=r.status, content_type=r.content_type)
                out = web.StreamResponse(status=r.status, headers={"content-type": r.headers.get("content-type", "text/event-stream")})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except asyncio.TimeoutError:
            return web.json_response({"error": {"message": f"the decode {d.url} did not answer in time"}}, status=504)
        except OSError as e:
            return web.json_response({"error": {"message": f"the decode {d.url} failed: {e}"}}, status=502)
        finally:
            d.busy -= 1

    async def models(request: web.Request):
        http = request.app["http"]
        async with http.get(decodes[0].url + "/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def health(request: web.Request):
        return web.json_response({"prefills": [b.url for b in prefills], "decodes": [b.url for b in decodes]})

    app = web.Application(client_max_size=64 << 20)
    app["tasks"] = set()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    for route in ROUTES:
        app.router.add_post(route, relay)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmove.vllm.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", type=parse_backend, action="append", required=True, help="URL=KVHOST:KVPORT")
    ap.add_argument("--decode", type=parse_backend, action="append", required=True, help="URL=KVHOST:KVPORT")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from aiohttp import web

    logger.info("prefills %s; decodes %s", [b.url for b in a.prefill], [b.url for b in a.decode])
    web.run_app(make_app(a.prefill, a.decode, a.timeout), host=a.host, port=a.port, print=None, shutdown_timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
