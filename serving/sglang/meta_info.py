"""Translations between our request types and SGLang's: sampling parameters out, and the
``meta_info`` of a finished output back (speculative stats, finish reason, refusals)."""

from __future__ import annotations

from serving.engine.base import RequestError, SamplingParams, SpecStats


def sglang_sampling_params(p: SamplingParams) -> dict:
    """Stop strings are not sent: the shared stop rules (serving.output.apply_stops) apply them
    and the engine aborts the request in SGLang."""
    params = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
              "ignore_eos": p.ignore_eos}
    if p.top_k:
        params["top_k"] = p.top_k
    if p.stop_token_ids:
        params["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        params["sampling_seed"] = p.seed
    return params


def spec_stats(meta_info: dict) -> SpecStats:
    """Per-request speculative stats (SGLang reports them on the finished output)."""
    return SpecStats(
        verify_steps=int(meta_info.get("spec_verify_ct", 0)),
        drafted_tokens=int(meta_info.get("spec_num_proposed_drafts", 0)),
        accepted_tokens=int(meta_info.get("spec_num_correct_drafts", 0)),
    )


def finish_reason(meta_info: dict) -> str | None:
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return kind if kind in ("stop", "length", "abort") else "stop"


def refused(meta_info: dict) -> RequestError | None:
    """SGLang ends a request it refuses (too long, bad parameters) with an abort carrying an HTTP
    status: 4xx is the request's fault (HTTP 400 for us), 5xx the server's."""
    reason = meta_info.get("finish_reason")
    if not isinstance(reason, dict) or reason.get("type") != "abort":
        return None
    status = reason.get("status_code")
    if not isinstance(status, int) or status < 400:
        return None
    return RequestError(str(reason.get("message") or "refused by SGLang"), invalid=status < 500)
