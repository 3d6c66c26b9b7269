"""SGLang attention backend of the ``sparse`` plugin (``--attention-backend kvreuse_sparse``): dense causal extend,
DIPR decode, over SGLang's own KV pool.

SGLang keeps K and V token by token (``MHATokenToKVPool``: per layer ``[slots, kv_heads, head_dim]``) and, with
``--page-size P``, allocates them in pages of ``P`` slots: a request's token ``t`` lives in slot ``page * P + t % P``
of the page ``req_to_token[req, t] // P``. That is the kernels' paged layout once the buffer is viewed as
``[slots / P, P, kv_heads, head_dim]``, so this backend only translates:

* the KV caches: a view of SGLang's per-layer buffers (no copy), block size = page size;
* the batch (``init_forward_metadata``): ``ForwardBatch`` -> ``kvreuse.sparse.paged.PagedBatch``, with the block
  table read from SGLang's ``req_to_token`` every ``P``-th column and ``out_cache_loc`` as the slot mapping;
* the forward calls: ``forward_extend``/``forward_decode`` -> ``SparseAttention.write`` (the K/V store and the
  keys' sketch) and ``SparseAttention.attend`` (dense causal for requests with several new tokens, DIPR for
  one-token decodes that the policy makes sparse).

On a GPU with ``sparse.engine_kernel`` (the default), every exact attention is SGLang's own FlashAttention
(``flash_attn_with_kvcache``, its ``fa3`` backend's kernel, through ``kvreuse.patches.sglang_0_5``) and DIPR is a
filter in front of it (``kvreuse.sparse.filtered_decode``): a forward pass without DIPR decodes is one call of it
over the whole batch; DIPR decodes read, per (sequence, KV head), only the pages the Triton sketch scan keeps, as
rows of a one-KV-head view of the pool (the pool is token-major, so KV head ``h`` of page ``p`` is the view's page
``p * page_size * kv_heads + h``).

Block pruning skips whole pages, so the backend needs ``--page-size`` of 2 or more (16 or more to save bytes: the
sketch of a page is read whole). It does not support CUDA graphs (``--disable-cuda-graph``), MLA,
sliding windows, logit soft-capping, cross attention or a quantized KV cache; start-up stops naming which. The
key sketch (``kvreuse.kernels.key_sketch``: an int8 code per key channel and an fp32 scale, per token, KV head and
layer) is allocated outside SGLang's KV memory budget.
Settings: ``KVREUSE_SPARSE_*`` (``SparseConfig``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from kvreuse.errors import ConfigError
from kvreuse.kernels.key_sketch import KeySketch
from kvreuse.patches import sglang_0_5
from kvreuse.sglang.names import BackendName
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import PagedBatch, SparseAttention

logger = logging.getLogger("sglang.plugins.kvreuse.attention")

_FLAG = f"--attention-backend {BackendName.SPARSE_ATTENTION}"


def paged_batch(forward_batch: ForwardBatch, req_to_token: torch.Tensor, page_size: int) -> PagedBatch:
    """One forward pass's batch in the kernels' terms (see the module docstring)."""
    bs = forward_batch.batch_size
    seq_lens = forward_batch.seq_lens[:bs]
    seq_lens_cpu = (forward_batch.seq_lens_cpu[:bs] if forward_batch.seq_lens_cpu is not None else seq_lens.cpu()).to(
        torch.int32
    )
    mode = forward_batch.forward_mode
    if mode.is_decode():
        query_lens = torch.ones(bs, dtype=torch.int32)
    elif mode.is_extend():
        query_lens = (
            torch.tensor(forward_batch.extend_seq_lens_cpu[:bs], dtype=torch.int32)
            if forward_batch.extend_seq_lens_cpu is not None
            else forward_batch.extend_seq_lens[:bs].cpu().to(torch.int32)
        )
    else:
        raise ConfigError(f"the kvreuse sparse attention backend does not run forward mode {mode.name}")
    query_start_loc_cpu = torch.zeros(bs + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc_cpu[1:])
    max_seq_len = int(seq_lens_cpu.max()) if bs else 0
    pages = -(-max_seq_len // page_size)
    tokens = req_to_token[forward_batch.req_pool_indices[:bs], : pages * page_size]
    device = seq_lens.device
    return PagedBatch(
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens=seq_lens.to(torch.int32),
        seq_lens_cpu=seq_lens_cpu,
        block_table=(tokens[:, ::page_size] // page_size).to(torch.int32),
        slot_mapping=forward_batch.out_cache_loc,
        num_actual_tokens=int(query_start_loc_cpu[-1]),
        max_seq_len=max_seq_len,
    )


class SparseAttnBackend(AttentionBackend):
    """SGLang's ``AttentionBackend`` over :class:`~kvreuse.sparse.paged.SparseAttention` (one per backend: all
    layers share its settings and figures; each layer has its own key sketch)."""

    def __init__(self, model_runner: Any, config: SparseConfig | None = None) -> None:
        super().__init__()
        self.device, self.page_size, self.req_to_token_pool, self.token_to_kv_pool, uses_mla = sglang_0_5.runner_kv(
            model_runner
        )
        problems = [
            what
            for what, given in (
                ("MLA models", uses_mla),
                (
                    f"KV pool {type(self.token_to_kv_pool).__name__} (sliding-window, hybrid or quantized KV caches)",
                    type(self.token_to_kv_pool) is not MHATokenToKVPool,
                ),
            )
            if given
        ]
        if problems:
            raise ConfigError(
                f"the kvreuse sparse attention backend does not support {', '.join(problems)}; "
                f"choose another --attention-backend for this model"
            )
        if self.page_size < 2:
            raise ConfigError(
                f"{_FLAG} prunes whole pages of the KV cache and needs --page-size 2 or more "
                f"(16 or more to read fewer bytes), got {self.page_size}"
            )
        self.config = config or SparseConfig.load()
        self.attention: SparseAttention | None = None
        self.sketches: dict[int, KeySketch] = {}
        self.forward_metadata: PagedBatch | None = None
        logger.info("kvreuse sparse attention: page size %d, %s", self.page_size, self.config)

    # -- metadata ---------------------------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = paged_batch(
            forward_batch, sglang_0_5.token_slot_table(self.req_to_token_pool), self.page_size
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise ConfigError(f"{_FLAG} does not support CUDA graphs: start SGLang with --disable-cuda-graph")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def support_triton(self) -> bool:
        return True

    # -- forward ----------------------------------------------------------------------------------------------------

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, save_kv_cache)

    def _forward(self, q, k, v, layer, save_kv_cache: bool) -> torch.Tensor:
        batch = self.forward_metadata
        attention = self._attention(layer)
        key_cache, value_cache, sketch = self._caches(layer)
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        if save_kv_cache and k is not None:
            attention.write(
                k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim), key_cache, value_cache, sketch, batch.slot_mapping
            )
        out = q.new_empty(q.shape[0], heads * dim)
        n = batch.num_actual_tokens
        attention.attend(
            layer.layer_id,
            q.view(-1, heads, dim)[:n],
            key_cache,
            value_cache,
            sketch,
            batch,
            out.view(-1, heads, dim)[:n],
        )
        return out

    def _attention(self, layer: Any) -> SparseAttention:
        if self.attention is None:
            problems = [
                what
                for what, given in (
                    ("cross attention", layer.is_cross_attention),
                    (f"attention type {layer.attn_type}", layer.attn_type != AttentionType.DECODER),
                    ("sliding windows", layer.sliding_window_size is not None and layer.sliding_window_size > -1),
                    ("logit soft-capping", bool(layer.logit_cap)),
                    ("different key and value head sizes", layer.qk_head_dim != layer.v_head_dim),
                )
                if given
            ]
            if problems:
                raise ConfigError(
                    f"the kvreuse sparse attention backend does not support {', '.join(problems)} "
                    f"(layer {layer.layer_id}); choose another --attention-backend for this model"
                )
            # On a GPU, with sparse.engine_kernel, DIPR is a filter in front of SGLang's own FlashAttention (its fa3
            # backend's kernel): buffers for as many requests and as long a context as SGLang's request table holds.
            flash = self.config.engine_kernel and torch.device(self.device).type == "cuda"
            requests = sglang_0_5.token_slot_table(self.req_to_token_pool)
            self.attention = SparseAttention(
                layer.tp_q_head_num,
                layer.tp_k_head_num,
                layer.qk_head_dim,
                self.page_size,
                layer.scaling,
                self.config,
                decode_kernel=sglang_0_5.flash_attention if flash else None,
                max_seqs=requests.shape[0],
                max_context=requests.shape[1],
            )
            self.attention.log = logger
        return self.attention

    def _caches(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor, KeySketch]:
        """The layer's K and V buffers as ``[pages, page_size, kv_heads, head_dim]`` views, and its key sketch."""
        keys, values = sglang_0_5.layer_kv_buffers(self.token_to_kv_pool, layer.layer_id)
        if keys.shape[0] % self.page_size:
            raise ConfigError(
                f"SGLang's KV buffer has {keys.shape[0]} slots, not a multiple of --page-size {self.page_size}"
            )
        key_cache = keys.view(-1, self.page_size, *keys.shape[1:])
        value_cache = values.view(-1, self.page_size, *values.shape[1:])
        sketch = self.sketches.get(layer.layer_id)
        if sketch is None or sketch.codes.shape[0] != key_cache.shape[0] or sketch.codes.device != key_cache.device:
            sketch = self.sketches[layer.layer_id] = self.attention.allocate_sketch(
                key_cache.shape[0], key_cache.device
            )
        return key_cache, value_cache, sketch
