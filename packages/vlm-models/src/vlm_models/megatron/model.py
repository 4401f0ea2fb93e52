"""Qwen3-VL on Megatron-Core: a native language model with the Transformers vision tower.

``Qwen3VLMegatronModel`` holds

* ``visual``: the HF ``Qwen3VLVisionModel`` itself (HF parameter names, HF code), on the first
  pipeline stage only and replicated over tensor-parallel ranks (it sees the same pixels on each);
* ``language_model``: a Megatron ``GPTModel`` with the Qwen3 decoder layer (GQA, per-head RMS
  QK-norm, SwiGLU or MoE, RMSNorm), Qwen3-VL's interleaved M-RoPE and deepstack.

Its forward mirrors HF ``Qwen3VLModel.forward``: embed the tokens, put the merged image
features at the image-token positions, add the deepstack features after the first decoder
layers, run the decoder, project to the vocabulary. Positions are the HF 3-D M-RoPE positions
(:func:`rope_position_ids`), given by the caller because under pipeline parallelism every stage
needs them while only the first holds the images.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn
from transformers import AutoModel, PretrainedConfig

from vlm_models.classes import select_classes
from vlm_models.megatron._upstream_fixes import (
    define_missing_te_gemm,
    use_packed_rope_without_host_reads,
)
from vlm_models.megatron.config import Parallelism, text_arch, transformer_config
from vlm_models.megatron.gated_delta_net import packs_samples
from vlm_models.megatron.layers import block_spec, param_device
from vlm_models.megatron.rope import InterleavedMRoPE
from vlm_models.vision_inputs import VisionInputs

logger = logging.getLogger(__name__)


class MRoPEGPTModel(GPTModel):
    """``GPTModel`` whose rotary embedding is Qwen3-VL's interleaved M-RoPE.

    Built with ``position_embedding_type="none"`` (so Megatron creates no rotary module of its
    own), then switched to GPTModel's ``"mrope"`` path with :class:`InterleavedMRoPE` in place of
    Megatron's Qwen2-VL-layout ``MultimodalRotaryEmbedding``. Embeddings are not scattered to the
    sequence-parallel region here: the VLM scatters after placing the image features.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec,
        vocab_size: int,
        *,
        mrope_section: list[int],
        rotary_base: float,
        rotary_dim: int | None = None,
        pre_process: bool,
        post_process: bool,
        share_embeddings_and_output_weights: bool,
        max_sequence_length: int = 262144,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="none",
            scatter_embedding_sequence_parallel=False,
            vp_stage=vp_stage,
        )
        self.position_embedding_type = "mrope"
        self.mrope_section = list(mrope_section)
        # Qwen3.5 rotates the first quarter of each head (rotary_dim); the rest pass through
        self.rotary_pos_emb = InterleavedMRoPE(rotary_dim or config.kv_channels, rotary_base)


class Qwen3VLMegatronModel(MegatronModule):
    """One pipeline stage of Qwen3-VL: HF vision tower (first stage) + Megatron decoder."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        config: TransformerConfig,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        use_te: bool = False,
        vision_attn_implementation: str = "sdpa",
        fast_patch_embed: bool = True,
        fused_vision_attention: bool = True,
        vp_stage: int | None = None,
        gdn_path: str = "auto",
    ) -> None:
        super().__init__(config=config)
        self.hf_config = hf_config
        self.arch = text_arch(hf_config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.use_te = use_te
        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules look up
        self.image_token_id = hf_config.image_token_id
        spec = block_spec(config, use_te=use_te, vp_stage=vp_stage, gdn_path=gdn_path)
        if pre_process and self.arch.deepstack_layers > len(spec.layer_specs):
            raise NotImplementedError(
                f"the first pipeline stage holds {len(spec.layer_specs)} decoder layers but "
                f"deepstack adds features after the first {self.arch.deepstack_layers}; give "
                "the first stage more layers (num_layers_in_first_pipeline_stage)"
            )
        if self.arch.num_experts:
            define_missing_te_gemm()
        use_packed_rope_without_host_reads()
        self.visual: nn.Module | None = None
        if pre_process:
            self.visual = AutoModel.from_config(
                hf_config.vision_config, attn_implementation=vision_attn_implementation
            ).to(device=param_device(config), dtype=config.params_dtype)
            # the model file's classes (vlm_models.qwen3_vl.model): GEMM patch embedding,
            # all images in one varlen kernel with bf16 rotary; same parameters and names
            select_classes(
                self.visual,
                fast_patch_embed=fast_patch_embed,
                fused_vision_attention=fused_vision_attention,
            )
        # the tower's per-patch inputs, when the caller computes them on the host
        self.vision_inputs = VisionInputs.attach_tower(self.visual)
        self.language_model = MRoPEGPTModel(
            config,
            spec,
            self.arch.vocab_size,
            mrope_section=self.arch.mrope_section,
            rotary_base=self.arch.rope_theta,
            rotary_dim=self.arch.rotary_dim,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.arch.tie_word_embeddings,
            vp_stage=vp_stage,
        )

    @property
    def packs_samples(self) -> bool:
        """Whether a packed THD row keeps its samples apart in every layer (attention always;
        gated-delta-net layers when they reset their state at boundaries). Where False the
        caller must run one sample per row."""
        return packs_samples(self.language_model)

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor]) -> None:
        """Pipeline schedules hand the previous stage's activations in here."""
        self.language_model.set_input_tensor(input_tensor)

    # megatron-core's finalize_model_grads looks these up on the module that has
    # ``pre_process`` (this one) to all-reduce a tied embedding's gradient over PP stages.
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def _merge_vision(
        self,
        embeddings: Tensor,
        input_ids: Tensor,
        pixel_values: Tensor,
        image_grid_thw: Tensor,
        image_positions: Tensor | None = None,
        vision_inputs: dict | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Put image features at the image tokens; return (embeddings, deepstack context).

        ``embeddings`` is ``[S, B, H]``; features fill the image tokens in (batch, position)
        order, as HF's ``masked_scatter`` on ``[B, S, H]`` does. With ``image_positions`` (the
        image tokens' flat indices into ``[B * S]``, computed on the host) and ``vision_inputs``
        (:class:`~vlm_models.vision_inputs.VisionInputs`, ``image_grid_thw`` then on the host)
        nothing here reads the device: the count check compares shapes and the merge indexes by
        position, where a boolean mask needs a device count forward and backward.
        """
        assert self.visual is not None
        injected = nullcontext()
        if vision_inputs is not None:
            if self.vision_inputs is None:
                raise ValueError(f"{type(self.visual).__name__} takes no precomputed inputs")
            injected = self.vision_inputs.use(vision_inputs)
        with injected:
            out = self.visual(
                pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw, return_dict=True
            )
        image_embeds = out.pooler_output
        batch, seq = input_ids.shape
        if image_positions is None:  # one device read: the count of image tokens
            image_positions = torch.nonzero(input_ids.reshape(-1) == self.image_token_id)[:, 0]
        n_tokens, n_features = image_positions.shape[0], image_embeds.shape[0]
        if n_tokens != n_features:
            raise ValueError(
                f"{n_tokens} image tokens (id {self.image_token_id}) in input_ids but the vision "
                f"tower produced {n_features} features from image_grid_thw {image_grid_thw.tolist()}"
            )
        dtype = embeddings.dtype
        flat = embeddings.transpose(0, 1).reshape(batch * seq, -1)
        merged = flat.index_copy(0, image_positions, image_embeds.to(dtype))
        merged = merged.view(batch, seq, -1).transpose(0, 1).contiguous()
        context = None
        if getattr(out, "deepstack_features", None):  # Qwen3-VL; Qwen3.5 has none
            features = torch.stack(list(out.deepstack_features), dim=1).to(dtype)  # [N, k, H]
            context = features.new_zeros(batch * seq, *features.shape[1:])
            context = context.index_copy(0, image_positions, features)
            context = context.view(batch, seq, *features.shape[1:]).transpose(0, 1).contiguous()
        return merged, context  # [S, B, H], [S, B, k, H]

    @contextmanager
    def _output_rows(self, rows: Tensor) -> Iterator[None]:
        """Make the output layer project only ``rows`` of the sequence during this forward.

        Under sequence parallelism the hidden states are first gathered (backward: this rank's
        slice, since the layer then all-reduces the input gradient over TP as it does for a
        replicated input), as Megatron's own last-token inference path does.
        """
        layer = self.language_model.output_layer
        sequence_parallel = layer.sequence_parallel
        project = layer.forward

        def forward(hidden: Tensor, *args, **kwargs):
            if sequence_parallel:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=False
                )
            return project(hidden.index_select(0, rows), *args, **kwargs)

        layer.forward = forward
        layer.sequence_parallel = False
        try:
            yield
        finally:
            del layer.forward  # the class's method again
            layer.sequence_parallel = sequence_parallel

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        *,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        attention_mask: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
        runtime_gather_output: bool | None = None,
        image_positions: Tensor | None = None,
        vision_inputs: dict | None = None,
        logit_rows: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, S, vocab / tp]`` on the last stage (full vocab with
        ``runtime_gather_output=True``), or per-token losses with ``labels``; the hidden states
        ``[S(/tp), B, H]`` on other stages. With ``logit_rows`` (positions in the whole,
        unscattered sequence; ``B == 1``) the output layer projects only those rows:
        ``[1, R, vocab / tp]``. A GRPO step needs the rows that predict response tokens, a
        fraction of a prompt-heavy VLM sequence, and the float32 logits of every row were most
        of the step's memory.

        ``input_ids`` ``[B, S]`` (packed THD: ``[1, T]`` with ``packed_seq_params``),
        ``position_ids`` ``[3, B, S]`` from :func:`rope_position_ids`, ``attention_mask`` None
        for causal attention. With sequence parallelism ``S`` must divide by ``tp``.
        ``image_positions`` and ``vision_inputs`` (see :meth:`_merge_vision`) keep the image
        merge free of host syncs.

        Context parallel (``packed_seq_params`` a
        :class:`~vlm_models.megatron.context_parallel.ContextParallelSeqParams`): ``input_ids``
        and ``position_ids`` are the whole row on every CP rank; the embeddings, the image
        merge (the vision tower runs on every CP rank: it is small, and its features land
        anywhere in the row) and the positions are computed whole, then split zigzag, and the
        decoder runs on this rank's part. ``logit_rows`` then index this rank's part and the
        outputs are this rank's tokens'.
        """
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [3, B, S], got {tuple(position_ids.shape)}")
        zigzag = getattr(packed_seq_params, "zigzag", None)
        if zigzag is None and self.config.context_parallel_size > 1:
            raise ValueError(
                "context parallelism needs ContextParallelSeqParams with the row's ZigzagLayout"
            )
        if zigzag is not None:  # this CP rank's tokens from here on (pad slots: position 0)
            position_ids = zigzag.split(position_ids, dim=2)
        decoder_input, context = None, None
        if self.pre_process:
            embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)
            if pixel_values is not None:
                if image_grid_thw is None:
                    raise ValueError("pixel_values given without image_grid_thw")
                embeddings, context = self._merge_vision(
                    embeddings,
                    input_ids,
                    pixel_values,
                    image_grid_thw,
                    image_positions=image_positions,
                    vision_inputs=vision_inputs,
                )
            if zigzag is not None:  # the image merge needed the whole row; now split it
                embeddings = zigzag.split(embeddings)
                context = None if context is None else zigzag.split(context)
            if self.config.sequence_parallel:
                tp = self.config.tensor_model_parallel_size
                if embeddings.shape[0] % tp:
                    raise ValueError(
                        f"sequence parallelism needs a length divisible by tp={tp}, got "
                        f"{embeddings.shape[0]}: pad the sequence"
                    )
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
                if context is not None:
                    context = tensor_parallel.scatter_to_sequence_parallel_region(context)
            decoder_input = embeddings
        selected = self._output_rows(logit_rows) if logit_rows is not None else nullcontext()
        with selected:
            return self.language_model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                decoder_input=decoder_input,
                labels=labels,
                loss_mask=loss_mask,
                packed_seq_params=packed_seq_params,
                extra_block_kwargs={"context": context} if context is not None else None,
                runtime_gather_output=runtime_gather_output,
            )


def build_megatron_model(
    hf_config: PretrainedConfig,
    parallel: Parallelism | None = None,
    *,
    config: TransformerConfig | None = None,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool = False,
    vision_attn_implementation: str = "sdpa",
    fast_patch_embed: bool = True,
    fused_vision_attention: bool = True,
    gdn_path: str = "auto",
    **config_overrides,
) -> Qwen3VLMegatronModel:
    """This rank's stage of the model (random init; load weights with ``load_hf_weights``).

    Megatron's model-parallel state must be initialised (:func:`initialize_model_parallel`).
    ``parallel`` defaults to the sizes that state was initialised with. ``gdn_path`` picks
    the gated-delta-net kernels of a Qwen3.5 model (``auto``, ``fla``, ``torch``; see
    :mod:`vlm_models.megatron.gated_delta_net`).
    """
    if config is None:
        if parallel is None:
            parallel = Parallelism(
                tp=parallel_state.get_tensor_model_parallel_world_size(),
                pp=parallel_state.get_pipeline_model_parallel_world_size(),
                ep=parallel_state.get_expert_model_parallel_world_size(),
                etp=parallel_state.get_expert_tensor_parallel_world_size(),
                cp=parallel_state.get_context_parallel_world_size(),
            )
        config = transformer_config(
            hf_config, parallel, params_dtype=params_dtype, **config_overrides
        )
    model = Qwen3VLMegatronModel(
        hf_config,
        config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        use_te=use_te,
        vision_attn_implementation=vision_attn_implementation,
        fast_patch_embed=fast_patch_embed,
        fused_vision_attention=fused_vision_attention,
        gdn_path=gdn_path,
    )
    device = param_device(config)
    if device.type == "cuda":
        # megatron-core 0.16.1 creates the shared expert's gate weight on the CPU always
        model.to(device)
    return model


class _RopeIndex:
    """Just enough of the HF ``*Model`` (Qwen3-VL, Qwen3.5) to call its own ``get_rope_index``."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        from vlm_models.packing import _model_class

        self.config = hf_config
        self._model_cls = _model_class(hf_config)

    def __call__(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self._model_cls.get_rope_index(self, *args, **kwargs)

    def get_vision_position_ids(self, *args, **kwargs) -> Tensor:
        return self._model_cls.get_vision_position_ids(self, *args, **kwargs)


def rope_position_ids(
    input_ids: Tensor,
    hf_config: PretrainedConfig,
    *,
    mm_token_type_ids: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> Tensor:
    """3-D M-RoPE positions ``[3, B, S]`` computed by HF's own ``get_rope_index``.

    Text-only input (no grids) gets ``arange`` on all three axes, as HF does.
    """
    if image_grid_thw is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1).contiguous()
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == hf_config.image_token_id).int()
    positions, _ = _RopeIndex(hf_config)(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
    )
    return positions
