"""Every SGLang symbol specloop relies on, in one list.

The contract test checks this list against the pinned wheel's source (parsed, never imported) and
SGLangEngine checks it against the installed package before launching, so a version that moved or
renamed a hook point fails with the symbol's name instead of silently capturing nothing.

A ``Symbol`` names a module and a dotted name inside it (function, class, method, class field,
enum member, ``self.x`` set in ``__init__``, or module constant) and, optionally:
  params     parameter names the definition must accept (``positional``: as its leading
             positional parameters, in this order, because we read them from ``*args``)
  mentions   identifiers or string literals that must occur inside the definition (a call we
             rely on being made, a dict key we read, a base class)
  returns    names of the tuple the definition's last ``return`` statement returns
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"
PLUGIN_GROUP = "sglang.srt.plugins"
HOOK_TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
"""The verify/sample function the trace plugin wraps (AROUND): every EAGLE/EAGLE3/STANDALONE
verify step goes through it via run_eagle_verify."""


@dataclass(frozen=True)
class Symbol:
    module: str
    name: str
    params: tuple[str, ...] = ()
    positional: bool = False
    mentions: tuple[str, ...] = ()
    returns: tuple[str, ...] = ()
    why: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


_PLUGINS = "sglang.srt.plugins"
_HOOKS = "sglang.srt.plugins.hook_registry"
_SPEC = "sglang.srt.speculative"
_IO = "sglang.srt.managers.io_struct"
_TM = "sglang.srt.managers.tokenizer_manager"
_TCM = "sglang.srt.managers.tokenizer_control_mixin"
_ENGINE = "sglang.srt.entrypoints.engine"
_FIELDS = "sglang.srt.arg_groups.fields"

PLUGIN_SYMBOLS: tuple[Symbol, ...] = (
    # Plugin discovery and hook registration (runs in every SGLang process, schedulers included).
    Symbol(_PLUGINS, "GENERAL_PLUGINS_GROUP", mentions=(PLUGIN_GROUP,),
           why="entry-point group our plugin is registered under"),
    Symbol(_PLUGINS, "load_plugins", mentions=("GENERAL_PLUGINS_GROUP", "apply_hooks"),
           why="loads general plugins, then applies registered hooks"),
    Symbol("sglang.srt.managers.scheduler", "run_scheduler_process", mentions=("load_plugins",),
           why="plugins are loaded inside the spawned scheduler process"),
    Symbol("sglang.srt.environ", "Envs.SGLANG_PLUGINS", why="allow-list of plugin names"),
    Symbol(_HOOKS, "HookRegistry.register", params=("target", "hook", "hook_type"),
           positional=True),
    Symbol(_HOOKS, "HookType.AROUND", why="hook(original_fn, *args, **kwargs) -> result"),
    # The verify path the hook sits on.
    Symbol(f"{_SPEC}.spec_info", "SpeculativeAlgorithm.create_worker",
           mentions=("StandaloneWorkerV2", "EAGLEWorkerV2"),
           why="STANDALONE and EAGLE3 pick the v2 workers"),
    Symbol(f"{_SPEC}.spec_info", "SpeculativeAlgorithm.STANDALONE"),
    Symbol(f"{_SPEC}.spec_info", "SpeculativeAlgorithm.EAGLE3"),
    Symbol(f"{_SPEC}.standalone_worker_v2", "StandaloneWorkerV2", mentions=("EAGLEWorkerV2",),
           why="inherits EAGLEWorkerV2.verify"),
    Symbol(f"{_SPEC}.eagle_worker_v2", "EAGLEWorkerV2.verify", mentions=("run_eagle_verify",)),
    Symbol(f"{_SPEC}.eagle_worker_common", "run_eagle_verify", params=("batch",),
           mentions=("eagle_sample",)),
    Symbol(f"{_SPEC}.eagle_utils", "eagle_sample",
           params=("verify_input", "batch", "logits_output"), positional=True,
           returns=("predict", "accept_lens", "accept_index"),
           why="hook target; accept_lens counts accepted drafts + the bonus token"),
    # What the hook reads from eagle_sample's inputs.
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.draft_token", why="[bs * N] tree tokens"),
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.retrieve_next_token", why="[bs, N] first child"),
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.positions", why="[bs * N]; node 0 = root"),
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.draft_token_num"),
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.topk"),
    Symbol(f"{_SPEC}.eagle_info", "EagleVerifyInput.draft_probs",
           why="[bs, steps, V] draft q, only under rejection sampling"),
    Symbol("sglang.srt.layers.logits_processor", "LogitsProcessorOutput.next_token_logits"),
    Symbol("sglang.srt.managers.schedule_batch", "ScheduleBatch.reqs"),
    Symbol("sglang.srt.managers.schedule_batch", "ScheduleBatch.forward_mode"),
    Symbol("sglang.srt.managers.schedule_batch", "Req.rid"),
    Symbol("sglang.srt.managers.schedule_batch", "Req.origin_input_ids"),
    Symbol("sglang.srt.model_executor.forward_batch_info", "ForwardMode.is_idle"),
    Symbol("sglang.srt.runtime_context", "get_parallel", why="export from attention-TP rank 0"),
    Symbol("sglang.srt.runtime_context", "_RANK_AND_WIDTH", mentions=("attn_tp_rank",)),
)

ENGINE_SYMBOLS: tuple[Symbol, ...] = (
    Symbol(_ENGINE, "Engine.__init__", mentions=("load_plugins",)),
    Symbol(_ENGINE, "Engine.tokenizer_manager"),
    Symbol(_ENGINE, "Engine.server_args"),
    Symbol(_ENGINE, "Engine.async_generate",
           params=("input_ids", "sampling_params", "stream", "rid", "return_logprob")),
    Symbol(_ENGINE, "Engine.shutdown"),
    Symbol(_ENGINE, "Engine.begin_weight_update", params=("selector",)),
    Symbol(_ENGINE, "Engine.end_weight_update"),
    # Engine.update_weights_from_tensor has no selector: we build the request ourselves and send it
    # through the tokenizer manager (the async side of the same calls).
    Symbol(_TM, "TokenizerManager", mentions=("TokenizerControlMixin",)),
    Symbol(_TM, "TokenizerManager.abort_request", params=("rid",)),
    Symbol(_TCM, "TokenizerControlMixin.begin_weight_update", params=("obj", "request"),
           positional=True),
    Symbol(_TCM, "TokenizerControlMixin.end_weight_update", params=("obj", "request"),
           positional=True),
    Symbol(_TCM, "TokenizerControlMixin.update_weights_from_tensor", params=("obj", "request"),
           positional=True),
    Symbol(_TCM, "TokenizerControlMixin.check_weights", params=("obj", "request"),
           positional=True, returns=("success", "message", "ranks", "per_engine_checksum")),
    Symbol(_IO, "BeginWeightUpdateReqInput.selector"),
    Symbol(_IO, "EndWeightUpdateReqInput"),
    Symbol(_IO, "UpdateWeightsFromTensorReqInput.serialized_named_tensors"),
    Symbol(_IO, "UpdateWeightsFromTensorReqInput.flush_cache"),
    Symbol(_IO, "UpdateWeightsFromTensorReqInput.selector"),
    Symbol(_IO, "CheckWeightsReqInput.action"),
    Symbol(_IO, "CheckWeightsReqInput.selector"),
    Symbol("sglang.srt.utils.common", "MultiprocessingSerializer.serialize", params=("obj",)),
    Symbol("sglang.srt.managers.scheduler_components.weight_updater",
           "SchedulerWeightUpdaterManager.update_weights_from_tensor",
           mentions=("_select_runners", "selector"), why="honours the draft selector"),
    # Per-request speculative stats and logprobs in meta_info.
    Symbol(_TM, "TokenizerManager._calculate_spec_decoding_metrics",
           mentions=("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")),
    Symbol(_TM, "TokenizerManager._handle_batch_output",
           mentions=("finish_reason", "prompt_tokens", "completion_tokens", "output_ids")),
    Symbol(_TM, "TokenizerManager.add_logprob_to_meta_info", mentions=("output_token_logprobs",)),
    # Sampling params we send (keys of the sampling_params dict).
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.max_new_tokens"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.temperature"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.top_p"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.top_k"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.stop_token_ids"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.ignore_eos"),
    Symbol("sglang.srt.sampling.sampling_params", "SamplingParams.sampling_seed"),
    # Server arguments we pass to sglang.Engine(**kwargs).
    Symbol(f"{_FIELDS}.model", "Model.model_path"),
    Symbol(f"{_FIELDS}.spec", "Spec.speculative_algorithm"),
    Symbol(f"{_FIELDS}.spec", "Spec.speculative_draft_model_path"),
    Symbol(f"{_FIELDS}.spec", "Spec.speculative_num_steps"),
    Symbol(f"{_FIELDS}.spec", "Spec.speculative_eagle_topk"),
    Symbol(f"{_FIELDS}.spec", "Spec.speculative_num_draft_tokens"),
    Symbol(f"{_FIELDS}.serving", "Serving.incremental_streaming_output"),
    Symbol(f"{_FIELDS}.observability", "Observability.enable_metrics"),
    Symbol(f"{_FIELDS}.parallel", "Parallel.tp_size"),
    Symbol(f"{_FIELDS}.schedule", "Schedule.mem_fraction_static"),
    Symbol(f"{_FIELDS}.schedule", "Schedule.max_running_requests"),
    Symbol(f"{_FIELDS}.model", "Model.dtype"),
    Symbol(f"{_FIELDS}.device", "Device.base_gpu_id"),
)

SYMBOLS: tuple[Symbol, ...] = PLUGIN_SYMBOLS + ENGINE_SYMBOLS


class SGLangContractError(RuntimeError):
    """The installed SGLang lacks a symbol specloop relies on."""
