"""``specloop bench train``: does distilling on served traces raise held-out acceptance?

Real traces from a TorchEngine (SmolLM2-135M, suffix drafter, MT-Bench chat prompts; target features
captured for EAGLE heads) are cached on disk with the trace codec, so re-runs skip generation. The
train traces arrive in chunks; after each the student trains a few steps and is scored on held-out
prompts of the same domain (the acceptance-vs-trace-tokens curve). Speedups are simulated inside the
hybrid policy with the suffix drafter, charged with the student's draft cost measured here.
``generate_traces`` is also the trainer's headline test's trace source (a tiny target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from benchmarks.output import json_option, print_json
from benchmarks.runner import check_precision, median_ms
from feedback.bus.trace import TraceRecord
from feedback.bus.trace_file import load_traces, save_traces
from kernels.cpu import cpu_info


def generate_traces(
    target,
    prompts: list[list[int]],
    *,
    k: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    feature_layers: tuple[int, ...] | None = None,
    domain: str = "default",
    tenant: str = "default",
    id_prefix: str = "req",
    max_batch_size: int = 8,
    seed: int = 0,
) -> list[TraceRecord]:
    """Serve ``prompts`` (token ids) on ``target`` (serving.target.Target) with the suffix drafter,
    ``max_new_tokens`` each (past EOS); one trace per prompt, in prompt order.
    ``feature_layers``: HF hidden_states indices captured into the traces."""
    from infra.offline_generation import serve_traces
    from serving.drafters.factory import build_drafter

    return serve_traces(target, prompts, domains=[domain] * len(prompts), drafter=build_drafter("suffix", target),
                        k=k, max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True,
                        feature_layers=feature_layers, tenant=tenant, id_prefix=id_prefix,
                        max_batch_size=max_batch_size, seed=seed)


# ---- measured draft cost ----------------------------------------------------------------------


def measure_draft_cost(target, student, context: int = 256) -> dict:
    """Per-token draft time of ``student`` (in the target's dtype, with a KV cache of ``context``
    positions) relative to one target decode step at the same context, on this machine."""
    import copy

    import torch
    from transformers import DynamicCache

    dtype = target.model.get_output_embeddings().weight.dtype
    ids = torch.randint(0, 1000, (1, context))
    with torch.inference_mode():
        cache = DynamicCache()
        target.model(ids, past_key_values=cache, use_cache=True)
        tok = ids[:, -1:]

        def target_step():
            target.model(tok, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        target_ms = median_ms(target_step)
        model = copy.deepcopy(student.model).to(dtype).eval()
        if student.kind == "eagle":
            model.attach_embeddings(target.model.get_input_embeddings().weight)
            dcache = DynamicCache()
            feats = torch.randn(1, context, model.config.feature_size, dtype=dtype)
            h = model(ids, features=feats, cache=dcache)[:, -1:]  # [1, 1, H]

            def draft_step():
                out = model(tok, h, cache=dcache)
                model.compute_logits(out).argmax(-1)
                dcache.crop(-1)
        else:
            dcache = DynamicCache()
            model(ids, past_key_values=dcache, use_cache=True)
            rows = getattr(student, "head_vocab", None)
            head = model.lm_head.weight if rows is None else model.lm_head.weight[rows].contiguous()

            def draft_step():  # the lm_head read only at the draft vocabulary, as serving does
                h = model.model(tok, past_key_values=dcache, use_cache=True).last_hidden_state
                torch.nn.functional.linear(h[:, -1], head).argmax(-1)
                dcache.crop(-1)

        draft_ms = median_ms(draft_step)
    return {"target_step_ms": target_ms, "draft_token_ms": draft_ms, "draft_cost": draft_ms / target_ms}


# ---- the benchmark ----------------------------------------------------------------------------


def _cached_traces(target, name: str, prompts, args, feature_layers, cache_dir,
                   domain: str = "chat") -> list[TraceRecord]:
    import hashlib
    import json

    key = hashlib.sha256(json.dumps([target.fingerprint.key(), prompts, args.max_new_tokens, args.k,
                                     list(feature_layers)]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"{name}-{key}.traces"
    if path.exists():
        return load_traces(path)
    traces = generate_traces(target, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                             feature_layers=feature_layers, domain=domain, id_prefix=name)
    save_traces(traces, path)
    return traces


STUDENTS = ("eagle", "standalone", "selfspec")
DOMAINS = ("chat", "code")
TRAIN_PROMPT_SETS = ("sharegpt",)
"""What ``--prompts`` takes besides its default (MT-Bench chat / HumanEval code): the cached traces
are named after it and the train / held-out split is the domain's prompts in set order."""


def _check_choices(args) -> None:
    """The command line's choices, for callers of ``run``: an unknown student trained standalone,
    an unknown domain HumanEval."""
    for name, value, allowed in (("student", args.student, STUDENTS), ("domain", args.domain, DOMAINS),
                                 ("prompts", args.prompts, (None, *TRAIN_PROMPT_SETS))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def run(args) -> dict:
    import time

    import torch

    from feedback.drafters.eagle_head import default_feature_layers, eagle_from_target
    from feedback.drafters.standalone_lm import standalone_from_target
    from feedback.drafters.vocab import day0_draft_vocab, special_token_ids
    from infra.prompts import interleave_categories, load_humaneval, load_mtbench, load_sharegpt
    from serving.target import load_target
    from trainer.distill import DistillConfig, Distiller, autocast_bf16
    from trainer.eagle_student import EagleStudent, traffic_frequencies
    from trainer.gate import GateConfig, build_suffix_index, score
    from trainer.replay import ReplayBuffer
    from trainer.students import StandaloneStudent

    autocast_bf16(args.precision, torch.device("cpu"))  # a bad value is refused before any work
    _check_choices(args)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    target = load_target(args.model)
    layers = default_feature_layers(int(target.model.config.num_hidden_layers))
    n_prompts = args.train_prompts + args.heldout_prompts
    if args.prompts == "sharegpt":  # the held-out real-user set: never tuned on
        items = [it for it in load_sharegpt(n_prompts, n_prompts) if it.domain == args.domain]
    else:
        items = interleave_categories(load_mtbench()) if args.domain == "chat" else load_humaneval()
    prompts = [it.token_ids(target.tokenizer) for it in items[:n_prompts]]
    train_p, held_p = prompts[: args.train_prompts], prompts[args.train_prompts :]
    # selfspec/standalone need no captured features: their traces are cached without them
    layers = layers if args.student == "eagle" else ()
    t0 = time.perf_counter()
    tag = "" if args.prompts is None else f"{args.prompts}-"
    train = _cached_traces(target, f"{tag}train", train_p, args, layers, args.cache_dir, args.domain)
    held = _cached_traces(target, f"{tag}heldout", held_p, args, layers, args.cache_dir, args.domain)
    gen_s = time.perf_counter() - t0

    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    if args.student == "eagle":
        dv = day0_draft_vocab(vocab, args.draft_vocab, special_token_ids(target.tokenizer, target.model.config),
                              frequencies=traffic_frequencies(train, vocab))
        student = EagleStudent(eagle_from_target(target.model, feature_layers=layers, draft_vocab=dv),
                               depth=args.depth, max_len=args.max_len)
    elif args.student == "selfspec" and args.init is not None:
        from trainer.students import selfspec_student_from_artifact

        student = selfspec_student_from_artifact(args.init, target.model, target.fingerprint, args.max_len)
    elif args.student == "selfspec":
        from feedback.drafters.from_target import assemble, selfspec_adapter_from_target
        from trainer.students import SelfSpecStudent

        dv = day0_draft_vocab(vocab, args.draft_vocab, special_token_ids(target.tokenizer, target.model.config),
                              frequencies=traffic_frequencies(train, vocab))
        adapter = selfspec_adapter_from_target(target.model, exit_layer=args.exit_layer,
                                               adapter_layers=args.adapter_layers,
                                               adapter_init=args.adapter_init, draft_vocab=dv)
        student = SelfSpecStudent(assemble(adapter, target.model), adapter.config, max_len=args.max_len)
    else:
        student = StandaloneStudent(standalone_from_target(target.model, num_layers=2).float(), max_len=args.max_len)
    cost = measure_draft_cost(target, student)
    gate = GateConfig(k=args.k, draft_cost=cost["draft_cost"], hybrid=True)
    suffix = build_suffix_index(train)

    replay = ReplayBuffer(heldout_size=len(held), fingerprint=target.fingerprint)
    for r in held:
        replay.add(r, heldout=True)
    before = score(student, held, gate, suffix)
    suffix_only = score(None, held, gate, suffix)
    distiller = Distiller(student, DistillConfig(lr=args.lr, batch_traces=args.batch_traces, max_len=args.max_len,
                                                 eval_every=args.eval_every, patience=10**6,
                                                 precision=args.precision))
    curve = [{"trace_tokens_seen": 0, "expected_acceptance": before.expected_acceptance,
              "sim_accept_len": before.sim_accept_len}]
    chunks = max(1, args.chunks)
    steps = train_s = 0.0
    best = before.expected_acceptance
    for c in range(chunks):
        lo, hi = len(train) * c // chunks, len(train) * (c + 1) // chunks
        for r in train[lo:hi]:
            replay.add(r, heldout=False)
        res = distiller.fit(replay, args.steps_per_chunk, k=args.k)
        steps += res.steps
        train_s += res.train_seconds
        best = max(best, res.best_acceptance)
        ev = distiller.evaluate(held, args.k)
        curve.append({"trace_tokens_seen": replay.tokens_seen, **ev, "train_steps": distiller.global_step})
    after = score(student, held, gate, suffix)
    return {
        "model": target.model_id, "student": args.student, "domain": args.domain, "k": args.k,
        **({"exit_layer": args.exit_layer, "adapter_layers": args.adapter_layers,
            "adapter_init": args.adapter_init, "draft_vocab": args.draft_vocab}
           if args.student == "selfspec" else {}),
        "init": str(args.init) if args.init else None, "prompts": args.prompts or "mtbench+humaneval",
        "cpu": cpu_info(),
        "train_prompts": len(train), "heldout_prompts": len(held), "max_new_tokens": args.max_new_tokens,
        "expected_acceptance_before": before.expected_acceptance, "expected_acceptance_after": after.expected_acceptance,
        "sim_accept_len_before": before.sim_accept_len, "sim_accept_len_after": after.sim_accept_len,
        "sim_speedup_before": before.sim_speedup, "sim_speedup_after": after.sim_speedup,
        "sim_speedup_suffix_only": suffix_only.sim_speedup,
        "trace_tokens_seen": replay.tokens_seen, "train_steps": int(steps),
        "precision": distiller.train_precision,
        "train_steps_per_s": steps / train_s if train_s else 0.0,
        **cost, "curve": curve,
        "trace_generation_s": gen_s, "total_s": time.perf_counter() - t_start,
        "note": "held-out = separate prompts of the domain (MT-Bench chat or HumanEval code); weights selected on held-out expected acceptance "
                "(as the gate does), so 'after' is the selected checkpoint's score on the selection set",
    }


def _check_train_prompts(value: str | None) -> str | None:
    """``--prompts``: the default or ``sharegpt`` only, refused before any work (a JSONL file given
    here used to be ignored, and the run trained on MT-Bench / HumanEval while reporting the file)."""
    if value is not None and value not in TRAIN_PROMPT_SETS:
        raise typer.BadParameter(f"{value!r}: choose {' or '.join(TRAIN_PROMPT_SETS)} (the held-out ShareGPT set), "
                                 "or leave it out for MT-Bench / HumanEval; bench train takes no prompt files")
    return value


def bench_train(
    json_out: bool = json_option(),
    model: str = typer.Option("SmolLM2-135M-Instruct", help="Target model."),
    student: Literal["eagle", "standalone", "selfspec"] = typer.Option("eagle", help="eagle | standalone | selfspec"),
    domain: Literal["chat", "code"] = typer.Option("chat", help="chat (MT-Bench) | code (HumanEval)."),
    prompts: str | None = typer.Option(None, callback=_check_train_prompts,
                                       help="sharegpt: the domain's prompts from the held-out ShareGPT set "
                                       "instead of MT-Bench / HumanEval (no prompt files here)."),
    init: Path | None = typer.Option(None, help="selfspec: start from this artifact (e.g. pre-trained with "
                                     "`specloop train --corpus`) instead of the day-0 copy of a target layer."),
    exit_layer: int = typer.Option(2, min=0, help="selfspec: target layers shared before the adapter."),
    adapter_layers: int = typer.Option(1, min=1, help="selfspec: trainable adapter decoder layers."),
    adapter_init: Literal["next", "last"] = typer.Option(
        "next", help="selfspec: adapter starts as target layer E (next) or its last (last)."),
    train_prompts: int = typer.Option(36, min=1, help="MT-Bench prompts whose traces train."),
    heldout_prompts: int = typer.Option(12, min=1, help="Held-out MT-Bench prompts (same domain)."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens generated per prompt."),
    k: int = typer.Option(4, min=1, help="Draft length (serving and gate)."),
    chunks: int = typer.Option(4, min=1, help="Train traces arrive in this many chunks (curve points)."),
    steps_per_chunk: int = typer.Option(40, min=1, help="Training steps after each chunk."),
    eval_every: int = typer.Option(20, min=1, help="Held-out evaluation interval (steps)."),
    batch_traces: int = typer.Option(4, min=1, help="Traces per step."),
    lr: float = typer.Option(1e-3, help="AdamW learning rate."),
    precision: str = typer.Option("auto", callback=check_precision,
                                  help="Training steps' forward: auto (bf16 autocast where the hardware "
                                  "has bf16 dot products), bf16 or fp32."),
    depth: int = typer.Option(3, min=1, help="EAGLE training-time-test chain depth."),
    draft_vocab: int = typer.Option(8192, min=1, help="EAGLE/selfspec draft vocabulary (by traffic frequency)."),
    max_len: int = typer.Option(512, min=1, help="Left-truncate training sequences."),
    threads: int = typer.Option(1, min=1, help="torch threads (1: two threads on 2 shared cores ran 10x slower here)."),
    cache_dir: str = typer.Option(str(Path.home() / ".cache" / "specloop" / "bench_train"),
                                                 help="Trace cache (re-runs skip generation)."),
) -> None:
    """Generate (or reuse) TorchEngine traces on MT-Bench, distil a drafter, report held-out gains."""
    from types import SimpleNamespace

    out = run(SimpleNamespace(**{k_: v for k_, v in locals().items() if k_ != "json_out"}))
    print_json(out, json_out)
