"""The gate's costs, measured on this machine: what one draft token and one verify forward cost
relative to one target decode step, timed on the paths serving runs (the closed loop, infra/loop.py,
hands them to the trainer's gate)."""

from __future__ import annotations

import torch

from infra.measure import median_ms, median_ratio


def measure_costs(target, student, k: int, context: int = 256, bf16_activations: bool = False) -> dict:
    """On this machine, relative to one target decode step at ``context``: one draft token of
    ``student`` (at its draft vocabulary, as a promoted version is served) and a verify forward of
    2..k+1 tokens (``verify_costs``; ``verify_cost`` is the k+1 one), all timed on
    the paths serving runs (TorchEngine's ModelRunner; the learned drafter serving builds, its
    whole ``propose`` of one token) and on a thread set up as its step thread, so the gate's
    simulation charges what serving pays and promotes only drafters that pay here.
    ``bf16_activations``: serving's (ServingSettings.bf16_activations): the target's forwards as
    served."""
    from kernels.threads import on_a_step_thread

    return on_a_step_thread(lambda: _measure_costs(target, student, k, context, bf16_activations))


def _measure_costs(target, student, k: int, context: int, bf16_activations: bool) -> dict:
    import copy

    from serving.drafters.base import DraftRequestView
    from serving.drafters.standalone import StandaloneDrafter
    from serving.engine.model_runner import ModelRunner

    ids = torch.randint(0, min(1000, int(target.model.config.vocab_size)), (1, context))
    model = copy.deepcopy(student.model).to(target.model.get_output_embeddings().weight.dtype).eval()
    with torch.inference_mode():
        runner = ModelRunner(target.model, target.device, bf16_activations=bf16_activations)
        cache = runner.new_cache(batch_size=1)
        runner.forward(cache, ids, logits_to_keep=1)
        cache.commit([context])
        # Uncommitted forwards: each call overwrites the last one's keys and values. Costs are
        # ratios to a step timed right before each sample (median_ratio), not ratios of medians.
        def step():
            runner.forward(cache, ids[:, :1])

        step_ms = median_ms(step, iters=12, warmup=1)
        verify_costs = [median_ratio(lambda n=n: runner.forward(cache, ids[:, : n + 1]), step)
                        for n in range(1, k + 1)]  # 1..k drafts
        # A promoted artifact records the student's draft vocabulary and serving reads the lm_head
        # at it (feedback/registry/artifact.py): charge that, through the drafter serving builds,
        # as the engine calls it each step: commit the token the last verify accepted, draft one.
        # The whole propose(): its bookkeeping around the net is part of what a draft costs.
        drafter = StandaloneDrafter(model, draft_vocab=student.head_vocab, target=target.model)
        history = ids[0].tolist()
        drafter.add_request(DraftRequestView("gate", history, context))
        drafter.propose([DraftRequestView("gate", history, context)], 1)  # commits the history
        accepted = iter(ids[0].tolist() * 2)

        def draft_token():
            token = next(accepted)
            history.append(token)
            drafter.on_verified("gate", [token], None)
            drafter.propose([DraftRequestView("gate", history, context)], 1)

        # In serving a target forward (270 MB of packed weights for SmolLM2) runs between two
        # drafts and evicts the drafter's weights from the CPU caches: time each draft after one.
        # Back to back, the drafter's weights partly stay in L3 and a draft looked 0.07 of a step
        # where serving measured 0.12.
        draft_cost = median_ratio(draft_token, step)
    return {"target_step_ms": step_ms, "verify_cost": verify_costs[-1],
            "verify_costs": verify_costs, "draft_cost": draft_cost}
