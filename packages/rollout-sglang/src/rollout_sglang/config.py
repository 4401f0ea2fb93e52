"""``RolloutConfig``: the rollout engine's settings, as plain data a launcher parses without
torch. What builds an engine from them is :mod:`rollout_sglang.build` (``build_engine``), which
imports this module and the engines; this one imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where they are made: a launcher parses the settings without them
    from rollout_sglang.sglang_client.common import SGLangConfig
    from weight_sync.weight_names import WeightNameCheck

Backend = Literal["auto", "sglang", "sglang-server", "hf"]
TransportKind = Literal["auto", "object-store", "cuda-ipc", "nccl", "disk"]
Policy = Literal["round_robin", "least_loaded"]  # how `EngineRouter` picks an engine


@dataclass
class RolloutConfig:
    """Everything the launcher needs to build the rollout engine.

    backend: "auto" (SGLang if installed, else HF), "sglang" (in-process engines),
        "sglang-server" (launched servers, or ``server_urls`` of running ones), "hf".
    num_engines: data-parallel engines behind a router (SGLang: each on its own
        ``tp_size`` GPUs, starting at ``base_gpu_id``; ports ``port + i``).
    mm_attention_backend: the vision attention kernel of SGLang ("sdpa" on B200).

    Fields with a help text are a launcher's settings (`rl_runtime.parse_config`); the
    launcher fills in the rest (the model folder, the image bounds).
    """

    model_path: str = ""
    backend: Backend = field(
        default="auto",
        metadata={
            "help": "rollout engine; auto: SGLang on GPUs when installed, else transformers",
            "flag": "rollout_engine",
            "choices": ("auto", "sglang", "hf"),  # what the launchers build
        },
    )
    num_engines: int = 1
    router_policy: Policy = "round_robin"
    # SGLang
    tp_size: int = field(
        default=1,
        metadata={
            "help": "GPUs per rollout engine (SGLang tensor parallel)",
            "flag": "rollout_num_gpus_per_engine",
            "ge": 1,
        },
    )
    ep_size: int = field(
        default=1,
        metadata={
            "help": "SGLang, MoE models: expert-parallel size inside each engine (divides "
            "--rollout-num-gpus-per-engine)",
            "flag": "sglang_ep_size",
            "ge": 1,
        },
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata={
            "help": "SGLang speculative decoding, e.g. NEXTN (Qwen3.5's MTP head as the draft "
            "model, kept from the checkpoint, not trained); default: off",
            "flag": "sglang_speculative_algorithm",
        },
    )
    speculative_num_steps: int = field(
        default=3,
        metadata={
            "help": "SGLang speculative decoding: draft steps (one draft per step, so steps + "
            "1 draft tokens)",
            "flag": "sglang_speculative_num_steps",
            "ge": 1,
        },
    )
    speculative_eagle_topk: int = field(
        default=1,
        metadata={
            "help": "SGLang speculative decoding: draft tokens kept per step",
            "flag": "sglang_speculative_eagle_topk",
            "ge": 1,
        },
    )
    speculative_num_draft_tokens: int | None = field(
        default=None,
        metadata={
            "help": "SGLang speculative decoding: tokens verified per step (default: draft "
            "steps + 1)",
            "flag": "sglang_speculative_num_draft_tokens",
            "ge": 1,
        },
    )
    max_running_requests: int | None = field(
        default=None,
        metadata={
            "help": "SGLang: requests decoding at once per engine (default: SGLang's choice)",
            "flag": "sglang_max_running_requests",
            "ge": 1,
        },
    )
    cuda_graph_bs: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "SGLang: the decode batch sizes captured as CUDA graphs (default: "
            "SGLang's list)",
            "flag": "sglang_cuda_graph_bs",
        },
    )
    dtype: str = "bfloat16"
    mem_fraction_static: float = field(
        default=0.6,
        metadata={
            "help": "SGLang: GPU memory fraction for weights+KV",
            "flag": "sglang_mem_fraction_static",
            "gt": 0,
            "lt": 1,
        },
    )
    mm_attention_backend: str | None = field(
        default=None,
        metadata={
            "help": "SGLang vision attention kernel ('sdpa' on B200, where fa3 is missing)",
            "flag": "sglang_mm_attention_backend",
        },
    )
    attention_backend: str | None = None
    context_length: int | None = None
    base_gpu_id: int = 0
    enable_memory_saver: bool = True
    host: str = "127.0.0.1"
    port: int = 30000
    server_urls: list[str] = field(default_factory=list)
    flatten_buckets: bool = False
    min_pixels: int | None = None  # the prompt processor's bounds: SGLang must use the same
    max_pixels: int | None = None
    enable_deterministic_inference: bool = False  # SGLang honours seeds only with it
    check_weight_names: bool = True  # refuse names SGLang's loader would skip
    extra_sglang_args: dict[str, Any] = field(default_factory=dict)
    # HF engine (see HFEngine): sequences decoding at once, the KV cache's share of free GPU
    # memory, CUDA-graph decode, torch.compile of the decode step's layer blocks
    device: str | None = None
    max_batch_size: int = field(
        default=256,
        metadata={
            "help": "transformers engine: sequences decoding at once (KV-cache slots)",
            "flag": "rollout_max_batch_size",
            "ge": 1,
        },
    )
    attn_implementation: str = "sdpa"
    kv_cache_fraction: float = field(
        default=0.5,
        metadata={
            "help": "transformers engine: the KV cache's share of the GPU memory free when it "
            "is taken (at each rollout, colocated)",
            "gt": 0,
            "lt": 1,
        },
    )
    cache_tokens: int | None = field(
        default=None,
        metadata={
            "help": "transformers engine: the KV cache's size in tokens (default: colocated "
            "on GPUs, the launcher's plan beside what the trainer keeps, shown by "
            "--print-config; else --kv-cache-fraction of the free GPU memory; 65536 on a CPU)",
            "flag": "rollout_cache_tokens",
            "ge": 1,
        },
    )
    cuda_graphs: bool = True
    compile_decode: bool = False
    decode_attention: Literal["auto", "triton", "sdpa", "matmul"] = field(
        default="auto",
        metadata={
            "help": "transformers engine's decode attention: auto (the Triton split-KV kernel, "
            "which reads each sequence's live keys only, on CUDA where triton imports; else "
            "sdpa), triton, sdpa (torch over the batch's KV bucket with a length mask), matmul"
        },
    )
    weights_cpu_backup: bool = field(
        default=False,
        metadata={
            "help": "keep a host copy of the engines' weights while their memory is released "
            "(colocated, while the trainer steps; SGLang's enable_weights_cpu_backup); off: "
            "they are dropped and the weight push after the step writes them all again, "
            "which saves host memory the size of the weights and two copies a step"
        },
    )
    # decode through transformers' own loop (hf/legacy.py) instead of the engine's decode step,
    # which covers Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (a reference; slow)
    legacy_decode: bool = False
    # MoE models: every completion carries the experts each token was routed to (SGLang's
    # return_routed_experts), for routing replay in the trainer; the launcher sets it
    return_routed_experts: bool = False
    # how trainer rank 0 sends weights (`choose_weight_transport`)
    weight_transport: TransportKind = field(
        default="auto",
        metadata={
            "help": "how weights reach the engines; auto: CUDA IPC colocated on one trainer GPU, "
            "NCCL to SGLang on GPUs of its own, else Ray's object store (which serves every "
            "layout); disk: safetensors files in the run's weight-sync folder (debugging)"
        },
    )

    def hf_engine_options(self) -> dict[str, Any]:
        """The transformers engine's settings (``HFEngine``'s keywords), for every builder."""
        return {
            "max_batch_size": self.max_batch_size,
            "kv_cache_fraction": self.kv_cache_fraction,
            "cache_tokens": self.cache_tokens,
            "cuda_graphs": self.cuda_graphs,
            "compile": self.compile_decode,
            "decode_attention": self.decode_attention,
            "legacy_decode": self.legacy_decode,
            "weights_backup": self.weights_cpu_backup,
            "return_routed_experts": self.return_routed_experts,
        }

    def check(self) -> None:
        sglang_only = {
            "--sglang-ep-size": self.ep_size > 1,
            "--sglang-speculative-algorithm": bool(self.speculative_algorithm),
            "--sglang-cuda-graph-bs": bool(self.cuda_graph_bs),
            "--sglang-max-running-requests": self.max_running_requests is not None,
        }
        given = [flag for flag, on in sglang_only.items() if on]
        if self.backend == "hf" and given:
            raise ValueError(f"{' / '.join(given)}: SGLang's; --rollout-engine hf has none")
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"--sglang-ep-size {self.ep_size} must divide --rollout-num-gpus-per-engine "
                f"{self.tp_size} (SGLang splits an engine's GPUs into expert groups)"
            )

    def server_args(self) -> dict[str, Any]:
        """SGLang server arguments of the settings without a field of `SGLangConfig`, then
        ``extra_sglang_args`` (which win)."""
        args: dict[str, Any] = {}
        if self.ep_size > 1:
            args["ep_size"] = self.ep_size
        if self.speculative_algorithm:
            args.update(
                speculative_algorithm=self.speculative_algorithm,
                speculative_num_steps=self.speculative_num_steps,
                speculative_eagle_topk=self.speculative_eagle_topk,
                speculative_num_draft_tokens=self.speculative_num_draft_tokens
                or self.speculative_num_steps + 1,
            )
            if self.enable_memory_saver:
                # the draft model's weights are not ours to push: released with the engine's
                # memory, they would come back empty (sglang 0.5.23 keeps a CPU copy only
                # with this flag, model_runner_components/load_model_utils.py)
                args["enable_draft_weights_cpu_backup"] = True
        if self.weights_cpu_backup and self.enable_memory_saver:
            args["enable_weights_cpu_backup"] = True
        if self.max_running_requests is not None:
            args["max_running_requests"] = self.max_running_requests
        if self.return_routed_experts:  # sglang 0.5.23 arg_groups/fields/exec_.py
            args["enable_return_routed_experts"] = True
        if self.cuda_graph_bs:
            # sglang 0.5.23's name for the decode graphs' batch sizes (arg_groups/fields/exec_.py)
            args["cuda_graph_bs_decode"] = list(self.cuda_graph_bs)
        return {**args, **self.extra_sglang_args}

    def sglang_config(self, index: int = 0) -> SGLangConfig:
        from rollout_sglang.sglang_client.common import SGLangConfig

        return SGLangConfig(
            model_path=self.model_path,
            tp_size=self.tp_size,
            dtype=self.dtype,
            mem_fraction_static=self.mem_fraction_static,
            mm_attention_backend=self.mm_attention_backend,
            attention_backend=self.attention_backend,
            context_length=self.context_length,
            base_gpu_id=self.base_gpu_id + index * self.tp_size,
            enable_memory_saver=self.enable_memory_saver,
            host=self.host,
            port=self.port + index,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            enable_deterministic_inference=self.enable_deterministic_inference,
            extra_args=self.server_args(),
        )

    def weight_name_check(self) -> WeightNameCheck | None:
        if not self.check_weight_names or not self.model_path:
            return None
        from weight_sync.weight_names import WeightNameCheck

        return WeightNameCheck.from_checkpoint(self.model_path)
