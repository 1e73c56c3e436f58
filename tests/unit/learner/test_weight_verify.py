"""The check after a push, against a server on loopback that answers /get_weights_by_name as SGLang
0.5.23 does for a model that cannot export a parameter (its Qwen2: HTTP 400, the body of
``http_server._create_error_response("Get parameter by name failed")``; `make sglang-contract`
builds that body with SGLang's own function)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.links import EngineLink
from rlmesh.learner.weight_sync.verify import check_engines

SGLANG_CANNOT_EXPORT = {"error": {"message": "Get parameter by name failed"}}


@pytest.fixture
def answering():
    """Starts a server answering every POST with (status, body); yields a function that starts one
    and returns its URL."""
    servers = []

    def start(status: int, body: dict) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def check(url: str) -> tuple[dict[str, str], EngineLink]:
    async def run():
        link = EngineLink(client=EngineClient(url, name="engine", timeout_s=10))
        failed: dict[str, str] = {}
        try:
            await check_engines([link], failed, {"model.norm.weight": torch.ones(4)})
        finally:
            await link.client.aclose()
        return failed, link

    return asyncio.run(run())


def test_a_model_sglang_cannot_read_back_is_not_checked_and_not_failed(answering):
    failed, link = check(answering(400, SGLANG_CANNOT_EXPORT))
    assert failed == {} and link.verifiable is False  # skipped from now on, counted by the pusher


def test_any_other_refusal_of_a_pushed_name_fails_the_engine(answering):
    failed, link = check(answering(400, {"error": {"message": "name='model.norm.weight': not found"}}))
    assert "model.norm.weight" in failed["engine"] and link.verifiable is True


def test_other_values_than_pushed_fail_the_engine(answering):
    failed, _ = check(answering(200, [0.0, 0.0, 0.0, 0.0]))
    assert "holds other values for model.norm.weight" in failed["engine"]
