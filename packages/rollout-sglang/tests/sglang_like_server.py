"""A stand-in for an SGLang server in CPU tests: the same HTTP routes and JSON shapes.

Generation is a deterministic function of the prompt (no model), so tests can check request
building, response parsing, routing and error isolation. Weight sync is real: the server joins
the broadcast group as SGLang's workers do (TCP rendezvous, a store prefixed by the group name,
a fresh gloo backend: ``init_weight_sync_group``) and receives the tensors, which
``/get_weights_by_name`` then returns. Trigger ids in a prompt: 999997 -> HTTP 400 for the whole
batch (as SGLang does for an invalid request), 999998 -> output without meta_info, 999999 ->
an aborted request.

Run: python sglang_like_server.py --port 30000 [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from PIL import Image

BAD_BATCH, MALFORMED, ABORT = 999997, 999998, 999999


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.calls = 0
        self.released = False
        self.group = None
        self.sync_timeout = timedelta(minutes=10)
        self.weights: dict[str, torch.Tensor] = {}
        self.last_sampling_params: dict | None = None


STATE = State()


def fake_output(ids: list[int], images: list[str], params: dict) -> dict:
    sizes = []
    for url in images:
        header, data = url.split(",", 1)
        assert header == "data:image/png;base64", header
        sizes.append(list(Image.open(io.BytesIO(base64.b64decode(data))).size))
    if ABORT in ids:
        finish = {"type": "abort", "message": "prompt rejected by the stand-in"}
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {"finish_reason": finish, "output_token_logprobs": []},
        }
    if MALFORMED in ids:
        return {"text": ""}
    seed = sum(ids) + 1000 * len(images) + int(params.get("sampling_seed") or 0)
    stop_ids = set(params.get("stop_token_ids") or [])
    tokens, finish = [], {"type": "length", "length": params["max_new_tokens"]}
    for k in range(params["max_new_tokens"]):
        token = (seed + 7 * k) % 50000
        tokens.append(token)
        if token in stop_ids:
            finish = {"type": "stop", "matched": token}
            break
    logprobs = [[-0.01 * (k + 1), t, None] for k, t in enumerate(tokens)]
    meta = {
        "id": "x",
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "completion_tokens": len(tokens),
        "output_token_logprobs": logprobs,
        "image_sizes": sizes,
    }
    return {"text": "", "output_ids": tokens, "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _reply(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {})
        elif self.path == "/stats":
            self._reply(
                200,
                {
                    "requests": STATE.requests,
                    "calls": STATE.calls,
                    "released": STATE.released,
                    "sampling_params": STATE.last_sampling_params,
                },
            )
        else:
            self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        route = getattr(self, "post_" + self.path.strip("/"), None)
        if route is None:
            self._reply(404, {"error": {"message": f"no route {self.path}"}})
            return
        route(body)

    def post_generate(self, body: dict) -> None:
        batch = body["input_ids"]
        single = bool(batch) and isinstance(batch[0], int)
        batch = [batch] if single else batch
        images = body.get("image_data") or [[] for _ in batch]
        if any(not ids or BAD_BATCH in ids for ids in batch):
            self._reply(400, {"error": {"message": "invalid request in batch"}})
            return
        assert body.get("return_logprob") is True
        with STATE.lock:
            STATE.calls += 1
            STATE.requests += len(batch)
            STATE.last_sampling_params = body["sampling_params"]
        outputs = [
            fake_output(ids, imgs, body["sampling_params"])
            for ids, imgs in zip(batch, images, strict=True)
        ]
        self._reply(200, outputs[0] if single else outputs)

    def post_release_memory_occupation(self, body: dict) -> None:
        STATE.released = True
        self._reply(200, {"success": True, "message": ""})

    def post_resume_memory_occupation(self, body: dict) -> None:
        STATE.released = False
        self._reply(200, {"success": True, "message": ""})

    def post_flush_cache(self, body: dict) -> None:
        self._reply(200, {})

    def post_init_weights_update_group(self, body: dict) -> None:
        # imported here so that starting the stand-in stays quick
        from rollout_sglang.weight_sync import init_weight_sync_group

        STATE.group = init_weight_sync_group(
            backend=body["backend"],
            master_address=body["master_address"],
            master_port=body["master_port"],
            world_size=body["world_size"],
            rank=body["rank_offset"],
            group_name=body["group_name"],
            timeout=STATE.sync_timeout,
        )
        self._reply(200, {"success": True, "message": "joined"})

    def post_update_weights_from_distributed(self, body: dict) -> None:
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=STATE.group)
            STATE.weights[name] = tensor
        self._reply(200, {"success": True, "message": f"{len(body['names'])} tensors"})

    def post_get_weights_by_name(self, body: dict) -> None:
        tensor = STATE.weights.get(body["name"])
        self._reply(200, None if tensor is None else tensor.float().flatten().tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--sync-timeout", type=float, default=600, help="weight-sync rendezvous timeout, seconds"
    )
    args = parser.parse_args()
    STATE.sync_timeout = timedelta(seconds=args.sync_timeout)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
