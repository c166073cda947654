"""Every SGLang internal sgl-kvc patches, calls, subclasses or reads, in one place, and the
start-up check of each. Written for sglang==0.5.23.

SGLang's public surface (the plugin entry point, `HookRegistry`, the attention and radix-cache
registries) is not enough for KV-cache eviction: the scheduler's moments, the request rows and
the KV pools are internals, and they change between SGLang versions. So each one sgl-kvc relies
on is named here with what it is used for, and `problems()` checks them when the plugin installs,
in every SGLang process: that each exists, that a function's leading parameters are the ones
sgl-kvc passes or receives (by name, not only `hasattr`), and that a class still has the
attributes sgl-kvc reads of its instances. Hooks are listed by the modules that register them
(`Hook`, `adapter.install`), with the parameters each relies on, and checked the same way.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import pkgutil
import types
from dataclasses import dataclass
from typing import Any, Callable

SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Internal:
    """One SGLang internal: a dotted path, the leading parameters sgl-kvc relies on (after
    `self` / `cls`; None: not a callable sgl-kvc calls), the attributes it reads of a class's
    instances, and what for."""

    path: str
    params: tuple[str, ...] | None = None
    attrs: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Hook:
    """A patch through SGLang's `HookRegistry`: target, hook function, kind (a `HookType` name)
    and the target's leading parameters the hook reads (after `self` / `cls`)."""

    target: str
    fn: Callable[..., Any]
    kind: str
    params: tuple[str, ...] = ()
    why: str = ""

    def internal(self) -> Internal:
        return Internal(self.target, self.params, why=f"{self.kind.lower()} hook: {self.why}")


_MM = "sglang.srt.mem_cache"
_MGR = "sglang.srt.managers"

# Called, subclassed or read (the hooks are in each module's `hook_table`).
INTERNALS: tuple[Internal, ...] = (
    # --- request and batch state the scheduler hooks read and rewrite ---------------------------
    Internal(f"{_MGR}.schedule_batch.Req", attrs=(
        "rid", "kv", "sampling_params", "origin_input_ids", "output_ids", "lock", "is_retracted",
        "skip_radix_cache_insert", "cached_tokens", "to_finish", "inflight_middle_chunks",
        "prefix_len", "extend_end", "already_computed", "full_untruncated_fill_ids", "return_logprob",
        "logprob_start_len",
        "multimodal_inputs", "discard_output_reason",
    ), why="per-request settings, rows, tree locks, finish and abort; chunks"),
    Internal(f"{_MGR}.schedule_batch.Req.finished", (), why="skip finished requests"),
    Internal(f"{_MGR}.schedule_batch.Req.owned_kv_len", (),
             why="what of a finished row SGLang frees (--strip-thinking-cache): a turn keeps only a row it owns whole"),
    Internal(f"{_MGR}.schedule_batch.Req.set_finish_with_abort", ("error_msg", "status_code"),
             why="a bad per-request setting is a 400"),
    Internal(f"{_MGR}.schedule_batch.FINISH_ABORT", ("message", "status_code", "err_type"),
             why="a request sgl-kvc failed on is aborted with a 500"),
    Internal(f"{_MGR}.schedule_batch.ReqKvInfo", attrs=(
        "req_pool_idx", "cache_protected_len", "kv_committed_len", "kv_allocated_len", "holds_kv",
    ), why="a request's row, its tree-owned prefix and its lengths (Req.kv)"),
    Internal(f"{_MGR}.schedule_batch.ScheduleBatch", attrs=(
        "reqs", "seq_lens", "seq_lens_cpu", "orig_seq_lens", "seq_lens_sum", "req_to_token_pool",
        "token_to_kv_pool_allocator", "tree_cache", "batch_is_full", "chunked_req", "forward_mode",
    ), why="compaction rewrites rows and lengths; admission reopens"),
    Internal(f"{_MGR}.schedule_batch.ScheduleBatch.check_decode_mem", (),
             why="compress before a retraction when the next decode step does not fit"),
    # --- a reconstruction pass (KVzip) is an extend SGLang prepares and runs (adapter/kvzip/forwards.py)
    Internal(f"{_MGR}.schedule_batch.Req.__init__",
             ("rid", "origin_input_text", "origin_input_ids", "sampling_params"),
             why="a reconstruction forward's short-lived request"),
    Internal(f"{_MGR}.schedule_batch.Req", attrs=("lora_id",),
             why="a reconstruction forward runs with its request's LoRA adapter"),
    Internal(f"{_MGR}.scheduler.Scheduler", attrs=("max_prefill_tokens",),
             why="a reconstruction forward reads no more tokens than a prefill forward"),
    Internal(f"{_MGR}.schedule_batch.ScheduleBatch.init_new",
             ("reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache", "model_config",
              "enable_overlap", "spec_algorithm"), why="a reconstruction forward's batch"),
    Internal(f"{_MGR}.schedule_batch.ScheduleBatch.prepare_for_extend", (),
             why="a reconstruction forward's slots and inputs, from SGLang's allocator"),
    Internal(f"{_MGR}.schedule_batch.ScheduleBatch", attrs=(
        "out_cache_loc", "input_ids", "prefill_input_ids_cpu", "device",
    ), why="a reconstruction forward's new slots (freed after it) and inputs"),
    Internal("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
             ("batch", "model_runner"), why="a reconstruction forward"),
    Internal("sglang.srt.model_executor.model_runner.ModelRunner.forward", ("forward_batch",),
             why="a reconstruction forward runs the model"),
    Internal(f"{_MGR}.scheduler.Scheduler", attrs=("tokenizer", "spec_algorithm"),
             why="a reconstruction's instruction and chat template; its batch"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder", attrs=("memory_budget",),
             why="a reconstruction forward's slots are reserved with its request's next chunk"),
    Internal(f"{_MM}.prefill_budget.PrefillBudget.reserve", ("extend_input_len", "max_new_tokens"),
             why="a reconstruction forward's slots are reserved with its request's next chunk"),
    Internal(f"{_MGR}.scheduler.Scheduler", attrs=(
        "tp_worker", "running_batch", "tree_cache", "token_to_kv_pool_allocator",
        "max_total_num_tokens", "max_running_requests", "req_to_token_pool", "chunked_prefill_size",
        "max_req_len", "max_req_input_len", "max_new_tokens_limit", "model_config", "chunked_req",
        "_pending_chunked_abort_req", "new_token_ratio_tracker",
    ), why="the compressor, /v1/kvc/stats, a prompt compressed between chunks and its abort"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder._get_running_request_total_token_offset", ("req",),
             why="the room the next prefill round has for a prompt's next chunk (chunk moment)"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder", attrs=("memory_budget", "can_run_list", "new_chunked_req"),
             why="admission reserves the copies of a chunked prompt's next pass in the round"),
    Internal(f"{_MM}.prefill_budget.PrefillBudget.reserve", ("extend_input_len", "max_new_tokens"),
             why="admission reserves the copies of a chunked prompt's next pass in the round"),
    Internal("sglang.srt.runtime_context.get_serving", (),
             why="--allow-auto-truncate: a request that cannot fit even compressed is cut, not refused"),
    Internal(f"{_MGR}.scheduler_components.new_token_ratio_tracker.NewTokenRatioTracker", attrs=("current",),
             why="the output share a prefill round reserves for running requests (chunk moment)"),
    Internal(f"{_MGR}.scheduler.Scheduler.process_pending_chunked_abort", (),
             why="a request failed between two chunks is released before its next chunk"),
    Internal("sglang.srt.constants.HEALTH_CHECK_RID_PREFIX",
             why="health checks are left out of the prefix-cache counts"),
    Internal("sglang.srt.managers.io_struct.TokenizedGenerateReqInput", attrs=(
        "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "mm_inputs",
    ), why="whether a new request is compressed between chunks"),
    Internal("sglang.srt.model_executor.forward_batch_info.ForwardBatch", attrs=(
        "positions", "req_pool_indices", "seq_lens_cpu", "extend_seq_lens", "extend_seq_lens_cpu",
        "extend_prefix_lens_cpu", "forward_mode", "encoder_lens",
    ), why="logical RoPE positions; observation of extends and decodes"),
    Internal("sglang.srt.model_executor.model_runner.ModelRunner", attrs=(
        "token_to_kv_pool", "req_to_token_pool", "attn_backend", "decode_attn_backend", "server_args",
        "is_draft_worker", "memory_pool_config", "kv_cache_dtype", "model",
    ), why="the store, the pools and the attention backend of a scheduler process; the model's RoPE"),
    Internal("sglang.srt.layers.rotary_embedding.RotaryEmbedding", attrs=(
        "head_size", "rotary_dim", "base", "is_neox_style",
    ), why="the model's RoPE, with which Expected Attention advances queries"),
    Internal("sglang.srt.layers.radix_attention.RadixAttention", attrs=(
        "layer_id", "tp_q_head_num", "qk_head_dim", "scaling", "logit_cap", "sliding_window_size",
        "is_cross_attention",
    ), why="decode attention and observation per layer"),
    # --- pools and the radix tree ---------------------------------------------------------------
    Internal(f"{_MM}.memory_pool.ReqToTokenPool", attrs=("req_to_token", "max_context_len"),
             why="rows of slots; widened for a reconstruction forward"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool", ("size", "page_size", "dtype", "head_num", "head_dim"),
             attrs=("start_layer", "layer_num", "k_buffer", "v_buffer", "store_dtype", "head_num",
                    "head_dim", "v_head_dim", "layer_transfer_counter", "memory_saver_adapter"),
             why="subclassed by the FP8 and unit pools"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.set_kv_buffer",
             ("layer", "loc_info", "cache_k", "cache_v", "k_scale", "v_scale"), why="overridden by both pools"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool._create_buffers", (), why="overridden by the FP8 pool"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool._create_buffers_normal", (), why="overridden by the unit pool"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.get_key_buffer", ("layer_id",), why="keys a policy scores"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.get_value_buffer", ("layer_id",),
             why="values a policy scores (Expected Attention)"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.get_kv_buffer", ("layer_id",), why="compaction moves"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.get_cpu_copy", ("indices",), why="FP8 retraction offload"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.load_cpu_copy", ("kv_cache_cpu", "indices"),
             why="FP8 retraction offload"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool.get_kv_size_bytes", (), why="pool bytes in /v1/kvc/stats"),
    Internal(f"{_MM}.memory_pool.MHATokenToKVPool._finalize_allocation_log", ("num_tokens",),
             why="the FP8 pool logs its layout"),
    Internal(f"{_MM}.memory_pool.unwrap_write_loc", ("loc_info",), why="pool writes"),
    Internal(f"{_MM}.common.checkpoint_kv_cache", ("req", "tree_cache"),
             why="a prompt's exact first chunks are published before it is compressed between chunks"),
    Internal(f"{_MM}.common.evict_from_tree_cache", ("tree_cache", "num_tokens"),
             why="room for the kept entries a first compaction copies out of the tree"),
    Internal(f"{_MM}.radix_cache.RadixCache", ("params",), why="the tree of compressing servers"),
    Internal(f"{_MM}.radix_cache.RadixCache.unlock", ("lock",), why="a compacted request drops its lock"),
    Internal(f"{_MM}.radix_cache.RadixCache.all_values_flatten", (), why="SGLKVC_CHECK invariants"),
    Internal(f"{_MM}.radix_cache.RadixCache.evictable_size", (), why="cached tokens in /v1/kvc/stats"),
    # --- shared documents (adapter/documents/__init__.py, document_pass.py, radix_cache.KvcRadixCache) ------
    Internal(f"{_MM}.radix_cache.RadixCache.match_prefix", ("params",), why="a document's node matched in place of tokens"),
    Internal(f"{_MM}.radix_cache.RadixCache.reset", (), why="documents dropped with the tree"),
    Internal(f"{_MM}.radix_cache.RadixCache._delete_leaf", ("node",), why="an evicted document leaves the registry"),
    Internal(f"{_MM}.radix_cache.RadixCache.insert", ("params",), why="a document's node published"),
    Internal(f"{_MM}.radix_cache.RadixCache.lock", ("node",), why="a document's node locked as a prefix"),
    Internal(f"{_MM}.radix_cache.RadixCache.path_device_indices", ("node",), why="a document's slots as a prefix"),
    Internal(f"{_MM}.radix_cache.RadixCache", attrs=("page_size", "disable", "root_node"),
             why="a document's node in the tree (invariants)"),
    Internal(f"{_MM}.radix_cache.RadixKey", ("token_ids", "extra_key"), why="a document's node's own namespace"),
    Internal(f"{_MM}.radix_cache.TreeNode", attrs=("parent", "children", "key", "value", "lock_ref", "last_access_time",
                                                    "hit_count"),
             why="a document's node; its uses for the LRU and LFU eviction policies"),
    Internal(f"{_MM}.radix_cache.RadixCache._inc_hit_count", ("node",), why="a document hit is a use for LFU"),
    Internal(f"{_MM}.radix_cache.RadixCache", attrs=("eviction_strategy", "token_to_kv_pool_allocator", "kv_events"),
             why="a document evicted to keep the documents' metadata within its reservation"),
    Internal(f"{_MM}.evict_policy.EvictionStrategy.get_priority", ("node",), why="which document is evicted first"),
    Internal(f"{_MM}.allocator.BaseTokenToKVPoolAllocator.free_segment", ("free_index", "start_pos"),
             why="a document's slots freed as SGLang's evict frees a leaf's"),
    Internal(f"{_MM}.base_prefix_cache.MatchPrefixParams", ("key", "cow_mamba", "req"), why="the matching request"),
    Internal(f"{_MM}.base_prefix_cache.MatchResult",
             ("device_prefix_len", "last_device_node", "last_host_node", "best_match_node"), why="a document hit"),
    Internal(f"{_MM}.base_prefix_cache.InsertParams", ("key", "value"), why="a document's node published"),
    Internal(f"{_MM}.radix_cache.RadixCache.claim_kv_row", ("req",), why="a finished turn stays in the tree"),
    Internal(f"{_MM}.radix_cache.RadixCache.free_kv_row", ("kv", "ranges"), why="a finished turn's slots are not freed"),
    Internal(f"{_MM}.radix_cache.RadixCache.on_release", ("req",), why="the turn a finished one supersedes is dropped"),
    Internal(f"{_MM}.common.release_kv_cache", ("req", "tree_cache"),
             why="claim_kv_row, then free_kv_row, of one release (a finished turn's slots)"),
    Internal(f"{_MGR}.schedule_batch.FINISH_MATCHED_TOKEN", ("matched",), why="a turn answered to its stop token"),
    Internal(f"{_MGR}.schedule_batch.FINISH_LENGTH", ("length",), why="a turn answered to its length"),
    Internal(f"{_MGR}.schedule_batch.Req.init_next_round_input", ("tree_cache",),
             why="a document hit: the fill ids after the document"),
    Internal(f"{_MGR}.schedule_batch.Req", attrs=("last_node", "full_untruncated_fill_ids", "extra_key", "cache_salt"),
             why="a document hit; a document's key"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder", attrs=("chunked_req_limit", "rem_chunk_tokens"),
             why="a chunk ends at the end of the document its request compresses between chunks"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder.add_one_req", ("req", "has_chunked_req", "truncation_align_size"),
             why="a chunk capped at a document's end is not aligned to nothing"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder", attrs=("tree_cache",),
             why="a request waits while one admitted in the same round compresses its document"),
    Internal(f"{_MGR}.schedule_policy.AddReqResult", attrs=("CONTINUE",),
             why="a request waiting for its document is passed over and the round goes on"),
    Internal(f"{_MGR}.schedule_policy.PrefillAdder._check_prefill_budget", ("req", "extend_input_len", "total_tokens",
                                                                          "swa_host_hit_length", "chunk_limit"),
             why="a first chunk ends at the end of the document its request compresses between chunks"),
    Internal(f"{_MGR}.scheduler.Scheduler", attrs=("waiting_queue",),
             why="a request waits while another compresses its document"),
    Internal(f"{_MGR}.schedule_batch.NextBatchPlan", attrs=("batch_to_run",),
             why="the requests a prefill round admitted: one compressing a document is registered"),
    Internal(f"{_MM}.radix_cache.RadixKey.__getitem__", ("idx",),
             why="a request compressing its document between chunks matches less than the document"),
    Internal(f"{_MM}.registry.register_radix_cache_backend", ("name", "factory"), why="the tree backend"),
    Internal(f"{_MM}.registry.get_radix_cache_factory", ("name",), why="the tree backend"),
    Internal(f"{_MM}.registry.default_radix_cache_factory", ("ctx",), why="fallback tree"),
    Internal(f"{_MM}.registry.TreeCacheBuildContext", attrs=(
        "params", "disable_radix_cache", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache",
    ), why="what the tree is built for"),
    # --- memory sizing --------------------------------------------------------------------------
    Internal("sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator", ("kvc",),
             why="resize the pool after charging sgl-kvc's buffers"),
    Internal(f"{_MM}.kv_cache_configurator.KVCacheConfigurator", attrs=(
        "model", "model_config", "is_draft_worker", "use_mla_backend", "is_hybrid_swa", "mambaish_config",
        "kv_cache_dtype", "server_args",
    ), why="pool class, sizing and model checks; whether documents may be held (the radix cache)"),
    # --- attention --------------------------------------------------------------------------------
    Internal("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
             why="the torch_native, flashinfer and triton backends are wrapped"),
    Internal("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
             ("q", "k", "v", "layer", "forward_batch", "save_kv_cache"), why="observation of extends"),
    Internal("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
             ("q", "k", "v", "layer", "forward_batch", "save_kv_cache"), why="observation of decodes"),
    Internal("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
             ("query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens"),
             why="replaced by sgl-kvc's batched kernel; a graph step reads the batch's rows and lengths"),
    Internal("sglang.srt.model_executor.forward_batch_info.ForwardBatch", attrs=("req_pool_indices", "seq_lens"),
             why="a decode step's rows and lengths, SGLang's static inputs under a CUDA graph"),
    Internal("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
             attrs=("model_runner",), why="--kv-decode-graphs on: the compressor of the graphs' model"),
    Internal("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
             ("query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens",
              "extend_prefix_lens", "extend_seq_lens"),
             why="a packed request's extend attends through its per-head tables"),
    Internal("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend",
             ("q", "k", "v", "layer", "forward_batch", "save_kv_cache"), why="observation of extends"),
    Internal("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_decode",
             ("q", "k", "v", "layer", "forward_batch", "save_kv_cache"), why="observation of decodes"),
    Internal("sglang.srt.layers.attention.triton_backend.TritonAttnBackend._forward_extend_kernel",
             ("layer",), why="over sgl-kvc's pools: FP8 rows dequantized, packed requests' own attention"),
    Internal("sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
             attrs=("token_to_kv_pool", "decode_attention_fwd"),
             why="which pool the Triton backend reads; its decode kernel call, sgl-kvc's over sgl-kvc's pools"),
    Internal("sglang.kernels.ops.attention.decode_attention.decode_attention_fwd",
             ("q", "k_buffer", "v_buffer", "o", "kv_indptr", "kv_indices"),
             why="the Triton backend's decode kernel call (its instance attribute), sgl-kvc's over its pools"),
    Internal("sglang.kernels.ops.attention.extend_attention.extend_attention_fwd",
             ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
              "kv_indices"), why="the Triton backend's extend kernel call, over FP8 rows dequantized"),
    Internal(f"{_MM}.base_prefix_cache.BasePrefixCache", why="the type of the tree backend sgl-kvc builds"),
    Internal("sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE", why="the FP8 and unit pools' memory-saver tag"),
    # --- the launcher and the HTTP server (sgl_kvc/launcher/, server/) -----------------------------
    Internal("sglang.srt.server_args.prepare_server_args", ("argv",), why="the launcher builds SGLang's arguments"),
    Internal("sglang.srt.server_args.ServerArgs.add_cli_args", ("parser",),
             why="the launcher reads SGLang's flags with SGLang's parser (`launcher.flags.sglang_flags`)"),
    Internal("sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger.merge_config_with_args",
             ("cli_args",), why="and a --config file's values as SGLang merges them"),
    Internal("sglang.launch_server.run_server", ("server_args",), why="the launcher runs SGLang's server"),
    Internal("sglang.srt.plugins.load_plugins", (), why="the launcher loads the plugin in its own process"),
    Internal("sglang.srt.entrypoints.engine._set_envs_and_config", ("server_args",),
             why="on a CPU the launcher forks SGLang's workers after SGLang chose spawn"),
    Internal("sglang.srt.utils.kill_process_tree", ("parent_pid",), why="the launcher stops SGLang's processes"),
    Internal("sglang.srt.utils.get_cpu_ids_by_node", (), why="CPU threads per tensor-parallel rank"),
    Internal("sglang.srt.entrypoints.http_server.app", why="server/ mounts /v1/kvc/stats and the body checks"),
    Internal("sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest",
             why="server/ validates a chat body before SGLang parses it"),
    Internal("sglang.srt.entrypoints.openai.protocol.CompletionRequest",
             why="server/ validates a completion body before SGLang parses it"),
    Internal("sglang.srt.managers.tokenizer_manager.TokenizerManager", attrs=("model_config",),
             why="server/ reads the vocabulary size"),
    Internal("sglang.srt.managers.tokenizer_manager.TokenizerManager.get_internal_state", (),
             why="/v1/kvc/stats asks every scheduler"),
    # --- runtime ----------------------------------------------------------------------------------
    Internal("sglang.srt.runtime_context.get_parallel", (), why="tensor-parallel group and sizes; data-parallel rank"),
    Internal("sglang.srt.runtime_context.get_schedule", (), why="page size when resizing the pool"),
    Internal("sglang.srt.entrypoints.http_server.get_global_state", (), why="/v1/kvc/stats"),
    Internal("sglang.srt.plugins.hook_registry.HookRegistry", attrs=("_patched",), why="hooks applied"),
)


def resolve(path: str) -> Any:
    owner, _, attr = path.rpartition(".")
    return getattr(pkgutil.resolve_name(owner), attr)


def problems(internals: tuple[Internal, ...] | list[Internal]) -> list[str]:
    """What does not match in the installed SGLang, one line each (empty: all as written for)."""
    found = []
    for item in internals:
        try:
            obj = resolve(item.path)
        except (ImportError, AttributeError, ValueError):
            found.append(f"{item.path}: missing")
            continue
        if item.params is not None:
            have = _leading_params(obj, len(item.params))
            if have is not None and have != item.params:
                found.append(f"{item.path}: takes ({', '.join(have)}), sgl-kvc needs ({', '.join(item.params)})")
        missing = [a for a in item.attrs if not _has_attribute(obj, a)]
        if missing:
            found.append(f"{item.path}: no attribute {', '.join(missing)}")
    return found


def _leading_params(obj: Any, n: int) -> tuple[str, ...] | None:
    """The first n parameter names of a callable, `self` / `cls` left out (None: no signature)."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return tuple(names[:n])


def _has_attribute(cls: Any, name: str) -> bool:
    """Whether instances of `cls` have attribute `name`: a class attribute, a dataclass field, an
    annotation, or an attribute a method of the class or a base assigns."""
    if not inspect.isclass(cls):
        return hasattr(cls, name)
    if hasattr(cls, name):
        return True
    for klass in inspect.getmro(cls):
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        if name in getattr(klass, "__annotations__", {}) or name in _assigned_attributes(klass):
            return True
    return False


@functools.cache
def _assigned_attributes(klass: type) -> frozenset[str]:
    """Attribute names stored (`x.name = ...`, tuple targets included) by the methods the class
    itself defines (the originals of those a hook patched), read from their bytecode (no source
    parsing)."""
    names: set[str] = set()
    pending = []
    for member in vars(klass).values():
        func = getattr(member, "__func__", member)
        func = getattr(func, "fget", func)  # a property's getter
        if callable(func):
            func = inspect.unwrap(func)  # a method a hook patched: the original's code
        code = getattr(func, "__code__", None)
        if code is not None:
            pending.append(code)
    while pending:
        code = pending.pop()
        names.update(i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR")
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(names)
