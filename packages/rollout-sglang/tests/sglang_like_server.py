"""A stand-in for an sglang 0.5.23 server in CPU tests: the routes we use, as SGLang answers them.

Each behaviour follows the sglang 0.5.23 source (paths under ``python/sglang/srt/`` of the
wheel, ``pip download --no-deps sglang==0.5.23``):

- ``/generate`` (``entrypoints/http_server.py``, ``managers/io_struct.py`` ``GenerateReqInput``):
  one request or a batch; ``sampling_params`` one dict or one per request. Prompts with images
  go through the placeholder expansion of ``multimodal/processors/base_processor.py``
  ``build_input_ids``: every id followed by ``<|image_pad|>`` starts an image, which is replaced
  by ``grid.prod() // merge**2`` pads, the grid coming from the model's HF image processor
  (``--processor``) given the ``image`` part of ``--mm-process-config`` as ``images_kwargs``.
  Already expanded pads fail as there: IndexError for one image, AssertionError for more (an
  HTTP 400 whose message names the error). ``meta_info.prompt_tokens`` is the expanded length.
- Seeds: ``sampling_seed`` counts only with ``--enable-deterministic-inference``
  (``sampling/sampling_batch_info.py``; unset seeds are 42 there); sampled tokens are then a
  function of (prompt, images, seed) as ``layers/sampler.py`` ``multinomial_with_seed`` hashes
  (seed, position). Without it, sampling is random.
- Weight updates (``managers/scheduler_components/weight_updater.py``):
  ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` answer
  ``{"success": false, ...}`` with HTTP 400 outside a ``/begin_weight_update`` ...
  ``/end_weight_update`` session; a second begin, or an end without begin, is refused too.
  ``/update_weights_from_tensor`` here cannot open the tensors (no CUDA): it records the call.
- ``/flush_cache`` answers plain text (200, or 400 while requests run);
  ``/release_memory_occupation`` and ``/resume_memory_occupation`` answer ``null`` and take
  ``tags`` (memory types; none: all), resuming a type not released is an error; release
  asserts an idle server (here: HTTP 400 ``{"error": {"message": ...}}`` as
  ``_create_error_response`` writes).
- ``/health`` answers 200 with an empty body; ``/get_weights_by_name`` the values as a list.

Weight sync over the broadcast group is real: the server joins as SGLang's workers do (TCP
rendezvous, a store prefixed by the group name, a fresh gloo backend) and receives the tensors.

Test triggers (not SGLang): a prompt holding 999997 -> HTTP 400 for the whole batch, 999998 ->
an output without meta_info, 999999 -> an aborted request, 999996 -> the request waits until
``POST /test_unblock`` (to hold a request in flight). ``GET /stats`` reports counters.

Run: python sglang_like_server.py --port 30000 [--host 127.0.0.1] [--enable-deterministic-inference]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import threading
import warnings
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist
from PIL import Image

BLOCK, BAD_BATCH, MALFORMED, ABORT = 999996, 999997, 999998, 999999
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.calls = 0
        self.running = 0
        self.offloaded: set[str] = set()  # the memory types released (SGLang's offload_tags)
        self.session = False
        self.updates = 0
        self.load_formats: list[str | None] = []
        self.refused_updates = 0
        self.flushes = 0
        self.group = None
        self.sync_timeout = timedelta(minutes=10)
        self.weights: dict[str, torch.Tensor] = {}
        self.last_sampling_params: list | dict | None = None
        self.last_input_ids: list | None = None
        self.expanded_lengths: list[int] = []
        self.deterministic = False
        self.image_token_id = 151655
        self.image_processor = None
        self.image_config: dict = {}
        self.unblock = threading.Event()


STATE = State()
#: sglang 0.5.23's GPU memory types (constants.py: GPU_MEMORY_ALL_TYPES), released and resumed
#: by tag; no tags means all of them
MEMORY_TYPES = ("kv_cache", "weights", "cuda_graph")


def image_tokens(url: str) -> int:
    """Vision tokens of one image: the grid of the model's HF image processor called with the
    ``image`` part of ``--mm-process-config`` as keyword arguments, as
    ``base_processor.py`` passes ``image_config`` in ``images_kwargs``."""
    header, data = url.split(",", 1)
    assert header == "data:image/png;base64", header
    image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    processor = STATE.image_processor
    grid = processor(images=[image], return_tensors="pt", **STATE.image_config)["image_grid_thw"]
    return int(grid.prod()) // processor.merge_size**2


def build_input_ids(prompt: list[int], tokens_per_image: list[int]) -> list[int]:
    """``base_processor.py`` ``build_input_ids`` for images: the same loop, the same failures."""
    starts = [i for i in range(len(prompt) - 1) if prompt[i + 1] == STATE.image_token_id]
    out, cur = [], 0
    for image, start in enumerate(starts):
        count = tokens_per_image[image]  # IndexError: more starts than images
        assert cur <= start  # AssertionError: expanded pads of a later image
        out += prompt[cur : start + 1] + [STATE.image_token_id] * count
        cur = start + 2
    return out + prompt[cur:]


def fake_output(ids: list[int], images: list[str], params: dict) -> dict:
    expanded = build_input_ids(ids, [image_tokens(u) for u in images])
    if ABORT in ids:
        finish = {"type": "abort", "message": "prompt rejected by the stand-in"}
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {"finish_reason": finish, "output_token_logprobs": []},
        }
    if MALFORMED in ids:
        return {"text": ""}
    if STATE.deterministic:
        seed = params.get("sampling_seed")
        rng = random.Random(f"{expanded}|{42 if seed is None else seed}")
    else:
        rng = random.Random()  # sampling_seed ignored
    stop_ids = set(params.get("stop_token_ids") or [])
    tokens, finish = [], {"type": "length", "length": params["max_new_tokens"]}
    for _ in range(params["max_new_tokens"]):
        token = rng.randrange(50000)
        tokens.append(token)
        if token in stop_ids:
            finish = {"type": "stop", "matched": token}
            break
    logprobs = [[-0.01 * (k + 1), t, None] for k, t in enumerate(tokens)]
    meta = {
        "id": "x",
        "finish_reason": finish,
        "prompt_tokens": len(expanded),
        "completion_tokens": len(tokens),
        "output_token_logprobs": logprobs,
    }
    return {"text": "", "output_ids": tokens, "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _reply(self, code: int, body) -> None:
        self._send(code, json.dumps(body).encode(), "application/json")

    def _text(self, code: int, text: str) -> None:
        self._send(code, text.encode(), "text/plain; charset=utf-8")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _result(self, success: bool, message: str) -> None:
        self._reply(200 if success else 400, {"success": success, "message": message})

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/stats":
            with STATE.lock:
                self._reply(
                    200,
                    {
                        "requests": STATE.requests,
                        "calls": STATE.calls,
                        "running": STATE.running,
                        "released": bool(STATE.offloaded),
                        "offloaded": sorted(STATE.offloaded),
                        "session": STATE.session,
                        "updates": STATE.updates,
                        "refused_updates": STATE.refused_updates,
                        "load_formats": STATE.load_formats,
                        "flushes": STATE.flushes,
                        "sampling_params": STATE.last_sampling_params,
                        "input_ids": STATE.last_input_ids,
                        "expanded_lengths": STATE.expanded_lengths,
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
        images = [images] if single else images  # one request: its list of images
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(batch)
        if any(not ids or BAD_BATCH in ids for ids in batch):
            self._reply(400, {"error": {"message": "invalid request in batch"}})
            return
        assert body.get("return_logprob") is True
        with STATE.lock:
            STATE.calls += 1
            STATE.requests += len(batch)
            STATE.running += len(batch)
            STATE.last_sampling_params = body["sampling_params"]
            STATE.last_input_ids = batch
        try:
            if any(BLOCK in ids for ids in batch):
                STATE.unblock.wait(timeout=120)
            outputs = [
                fake_output(ids, imgs, p)
                for ids, imgs, p in zip(batch, images, params, strict=True)
            ]
        except (IndexError, AssertionError) as exc:  # what the mm processor raises
            self._reply(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
            return
        finally:
            with STATE.lock:
                STATE.running -= len(batch)
        STATE.expanded_lengths = [o.get("meta_info", {}).get("prompt_tokens") for o in outputs]
        self._reply(200, outputs[0] if single else outputs)

    def post_test_unblock(self, body: dict) -> None:
        STATE.unblock.set()
        self._reply(200, {})

    def post_release_memory_occupation(self, body: dict) -> None:
        if STATE.running:
            message = "release_memory_occupation should be called only when server is idle."
            self._reply(400, {"error": {"message": message}})
            return
        STATE.offloaded |= set(body.get("tags") or MEMORY_TYPES)
        self._reply(200, None)

    def post_resume_memory_occupation(self, body: dict) -> None:
        # sglang 0.5.23 takes each tag off its offload_tags with set.remove
        # (managers/scheduler_components/weight_updater.py): a type not released is an error
        tags = body.get("tags") or MEMORY_TYPES
        missing = [t for t in tags if t not in STATE.offloaded]
        if missing:
            self._reply(400, {"error": {"message": f"KeyError: {missing[0]!r}"}})
            return
        STATE.offloaded -= set(tags)
        self._reply(200, None)

    def post_flush_cache(self, body: dict) -> None:
        if STATE.running:
            self._text(400, "Flush cache failed.\n")
            return
        STATE.flushes += 1
        self._text(200, FLUSHED)

    def post_begin_weight_update(self, body: dict) -> None:
        if STATE.session:
            self._result(
                False, "a weight-update session is already open; call end_weight_update() first"
            )
            return
        STATE.session = True
        self._result(True, "Success")

    def post_end_weight_update(self, body: dict) -> None:
        if not STATE.session:
            self._result(
                False, "no weight-update session is open; call begin_weight_update() first"
            )
            return
        STATE.session = False
        self._result(True, "Success")

    def _refuse_outside_session(self, what: str) -> bool:
        if STATE.session:
            return False
        STATE.refused_updates += 1
        self._result(
            False, f"{what} must run between begin_weight_update() and end_weight_update()"
        )
        return True

    def post_update_weights_from_tensor(self, body: dict) -> None:
        if self._refuse_outside_session("update_weights_from_tensor"):
            return
        payloads = body.get("serialized_named_tensors")
        # utils/common.py normalize_serialized_named_tensor_payload: each entry a base64
        # string (or pickle bytes); one per TP rank, each rank reading its own
        # (managers/tp_worker.py deserialize_own_rank)
        try:
            for payload in payloads:
                base64.b64decode(payload, validate=True)
        except (TypeError, ValueError) as err:
            self._reply(400, {"error": {"message": f"TypeError: {err}"}})
            return
        STATE.updates += 1
        STATE.load_formats.append(body.get("load_format"))
        self._result(True, "Success")

    def post_init_weights_update_group(self, body: dict) -> None:
        # imported here so that starting the stand-in stays quick
        from weight_sync.nccl import init_weight_sync_group

        STATE.group = init_weight_sync_group(
            backend=body["backend"],
            master_address=body["master_address"],
            master_port=body["master_port"],
            world_size=body["world_size"],
            rank=body["rank_offset"],
            group_name=body["group_name"],
            timeout=STATE.sync_timeout,
        )
        self._result(True, "Succeeded to initialize custom process group.")

    def post_update_weights_from_distributed(self, body: dict) -> None:
        if self._refuse_outside_session("update_weights_from_distributed"):
            return
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=STATE.group)
            STATE.weights[name] = tensor
        STATE.updates += 1
        self._result(True, "Succeeded to update parameter online.")

    def post_get_weights_by_name(self, body: dict) -> None:
        tensor = STATE.weights.get(body["name"])
        if tensor is None:
            self._reply(400, {"error": {"message": "Get parameter by name failed"}})
            return
        self._reply(200, tensor.float().flatten().tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--mm-process-config", type=json.loads, default=None)
    parser.add_argument("--processor", help="model folder whose image processor sizes images")
    parser.add_argument(
        "--sync-timeout", type=float, default=600, help="weight-sync rendezvous timeout, seconds"
    )
    args, _ = parser.parse_known_args()  # SGLang's other flags mean nothing here
    STATE.sync_timeout = timedelta(seconds=args.sync_timeout)
    STATE.deterministic = args.enable_deterministic_inference
    if args.processor:
        from transformers import AutoConfig, AutoImageProcessor

        warnings.filterwarnings("ignore", category=FutureWarning)  # min/max_pixels kwargs
        STATE.image_processor = AutoImageProcessor.from_pretrained(args.processor)
        STATE.image_token_id = AutoConfig.from_pretrained(args.processor).image_token_id
    STATE.image_config = (args.mm_process_config or {}).get("image", {})
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
