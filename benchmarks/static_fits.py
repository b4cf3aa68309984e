"""``bench online``'s offline static baselines: the drafter a user would train before deploying,
distilled from the target's own responses to the pre-shift prompts, trained once per recipe and,
where the run leaves a core free, in a process of its own while other work is served.

A learned kind's stream keeps its trainer on the second core; the suffix kind has none. So
``run_all`` serves the suffix kind first and starts the learned kinds' static fit in the background
at the suffix stream's shift (``StaticFits.start``): the fit takes that idle core, as a trainer
would, and the learned kinds find it done instead of training it inline (about a minute on one
core, plus teacher-forcing the responses).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from pathlib import Path

log = logging.getLogger(__name__)


class StaticFits:
    """The offline static baselines of one run, by what they are trained from: the hybrid and the
    learned-only kinds share one learned student, the same start and the same (greedy, lossless)
    pre-shift responses, so the second kind loads the first one's artifact instead of repeating
    its minute of training. The artifacts live in ``directory``."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self._done: dict[tuple, tuple] = {}
        self._pending: dict[tuple, tuple] = {}  # key -> (path, process, receiving end)
        self._paths = 0

    @staticmethod
    def key(cfg, pre, steps: int) -> tuple:
        recipe = (cfg.day0_init, cfg.day0_artifact, cfg.selfspec_exit_layer, cfg.selfspec_adapter_layers,
                  cfg.draft_vocab_size, cfg.k, cfg.batch_traces, steps)
        return recipe + (tuple((tuple(p), tuple(o)) for p, o in pre),)

    def _next_path(self) -> Path:
        """A directory no fit has used (a failed background fit's is left as it is)."""
        self._paths += 1
        return self.directory / f"static-{self._paths - 1}"

    def start(self, cfg, pre, steps: int, load_target, fingerprint, nice: int = 10) -> None:
        """Begin fitting ``cfg``'s recipe on ``pre`` in a process of its own (one thread, ``nice``
        steps nicer than serving), which loads the target with ``load_target`` (picklable; checked
        against ``fingerprint``). A later ``get_or_fit`` of the same key waits for it."""
        key = self.key(cfg, pre, steps)
        if key in self._done or key in self._pending:
            return
        path = self._next_path()
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_fit_in_process, name="specloop-static-fit", daemon=True,
                           args=(send, load_target, fingerprint, [tuple(x) for x in pre], cfg, steps, str(path), nice))
        proc.start()
        send.close()  # the child holds the only sending end: its death reads as EOF
        self._pending[key] = (path, proc, receive)
        log.info("bench online: the static baseline trains in the background (%d responses)", len(pre))

    def get_or_fit(self, key: tuple, fit) -> tuple:
        """(artifact directory, fit figures) for ``key``: an earlier fit's (figures marked
        ``reused``), a background fit's (waited for; marked ``background``), or ``fit(directory)``'s,
        which saves the artifact there."""
        done = self._done.get(key)
        if done is not None:
            return done[0], {**done[1], "reused": True}
        pending = self._pending.pop(key, None)
        if pending is not None:
            path, proc, receive = pending
            t0 = time.perf_counter()
            try:
                status, figures = receive.recv()
            except EOFError:
                status, figures = "error", f"the process exited with {proc.exitcode}"
            proc.join()
            if status == "ok":
                figures = {**figures, "background": True, "waited_s": round(time.perf_counter() - t0, 1)}
                self._done[key] = (path, figures)
                return path, figures
            log.error("the background static fit failed (%s): fitting here instead", figures)
        path = self._next_path()
        figures = fit(path)
        self._done[key] = (path, figures)
        return path, figures

    def close(self) -> None:
        """Stop background fits nobody asked for (the run ended or failed first)."""
        for _, proc, receive in self._pending.values():
            proc.terminate()
            proc.join()
            receive.close()
        self._pending.clear()


def _fit_in_process(send, load_target, fingerprint, pre, cfg, steps: int, artifact: str, nice: int) -> None:
    """A spawned process's whole job: the target, ``_fit_static`` on one thread, and its figures
    (or what went wrong) sent back."""
    try:
        import torch

        from feedback.background.priority import lower_thread_priority

        torch.set_num_threads(1)
        lower_thread_priority(nice, "static fit")
        target = load_target()
        if not target.fingerprint.matches(fingerprint):
            raise RuntimeError(f"the background fit loaded another target ({target.fingerprint.key()})")
        send.send(("ok", _fit_static(target, pre, cfg, steps, artifact)))
    except Exception as e:  # noqa: BLE001 - anything: the parent fits inline instead
        send.send(("error", repr(e)))
    finally:
        send.close()


def static_drafter(target, loop, cfg, steps: int = 200, fits: StaticFits | None = None):
    """The well-trained static baseline a user would deploy: the loop's learned kind, distilled
    offline (trainer/offline.py, the online trainer's Distiller) from the target's own greedy
    responses to the pre-shift prompts (the loop served them losslessly, so they are reused rather
    than generated again), loaded through an artifact as a swap would; for the hybrid, joined to a
    suffix index of the pre-shift outputs. Neither learns any more. With ``fits``, a student
    already trained (or training) from the same start on the same responses is loaded instead."""
    import tempfile

    from infra.day0 import FrozenDrafter, learned_kind
    from serving.drafters.factory import build_drafter

    pre = loop.served[: loop.snapshot_at]
    kind = learned_kind(cfg)
    vocab = {"draft_vocab_size": cfg.draft_vocab_size}
    with tempfile.TemporaryDirectory(prefix="specloop-static-") as tmp:
        artifact, fit = (fits or StaticFits(tmp)).get_or_fit(
            StaticFits.key(cfg, pre, steps), lambda path: _fit_static(target, pre, cfg, steps, path))
        if cfg.drafter == "hybrid":
            suffix = build_drafter("suffix", target)
            for prompt, output in pre:
                suffix.observe(loop.tenant, output, prompt_ids=prompt)
            drafter = build_drafter("hybrid", target, artifact, learned=kind, learned_options=vocab,
                                    suffix=suffix)
        else:
            drafter = build_drafter(kind, target, artifact, **vocab)
    return FrozenDrafter(drafter), fit


def _fit_static(target, pre, cfg, steps: int, artifact) -> dict:
    """Distil the loop's learned kind from the pre-shift responses; save it to ``artifact``."""
    from feedback.drafters.standalone_lm import StandaloneConfig
    from feedback.registry.artifact import save_drafter
    from infra.day0 import make_selfspec_student, make_student
    from trainer.distill import DistillConfig
    from trainer.export import student_draft_vocab
    from trainer.offline import teacher_trace, train_offline

    records = [teacher_trace(target.model, target.fingerprint, list(p), list(o), domain="pre-shift")
               for p, o in pre if o]
    if cfg.day0_init == "selfspec" or cfg.day0_artifact:  # the same start as the loop's student
        student = make_selfspec_student(target, cfg.draft_vocab_size, cfg.selfspec_exit_layer,
                                        cfg.selfspec_adapter_layers, cfg.day0_artifact)
    else:
        student = make_student(target, cfg.draft_vocab_size, cfg.day0_init)
    fit = train_offline(student, records, target.fingerprint, max_steps=steps, k=cfg.k,
                        distill=DistillConfig(lr=3e-3, batch_traces=cfg.batch_traces))
    target.model.eval()  # a selfspec student shares the target's first layers; training flagged them
    config = getattr(student, "config", None) or StandaloneConfig.for_target(target.model.config)
    save_drafter(student.model, config, target.fingerprint, artifact, version="static",
                 draft_vocab=student_draft_vocab(student), from_target=getattr(student, "from_target", None))
    return fit
