"""Acceptance of the suffix drafter on real prompts, by simulation (greedy, no target in the loop).

1. Target greedy outputs for MT-Bench (chat, first turns, chat template) and HumanEval (code, raw
   prompts) are produced once with the real SmolLM2 target and cached as JSON under
   ``~/.cache/specloop/suffix_sim_outputs.json`` (47 min the first time on 2 busy shared cores).
2. Greedy speculative decoding is then replayed exactly: at each verify step the drafter proposes
   up to k tokens for the context so far, the accepted count is the longest prefix that equals the
   target's own greedy continuation, and accepted + 1 tokens are committed.

Per domain, prompts are split into a warm-up set (its outputs feed the tenant index, as finished
requests would) and a held-out set. Reported: tokens per verify step (accepted + 1) on the
held-out prompts with a cold index (day 0: prompt lookup only) and with a warmed index.

    .venv/bin/python -m benchmarks.suffix_sim            # generate (once) and simulate
    .venv/bin/python -m benchmarks.suffix_sim --k 8 --set min_confidence=0.2 --calibration
    .venv/bin/python -m benchmarks.suffix_sim --speed      # lookup time vs index size
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "specloop" / "suffix_sim_outputs.json"


@dataclass
class Sample:
    id: str
    domain: str
    category: str
    prompt_ids: list[int]
    output_ids: list[int]


def generate_samples(
    path: Path = DEFAULT_CACHE, max_new_tokens: int = 96, batch_size: int = 8
) -> list[Sample]:
    """Target greedy outputs for every MT-Bench and HumanEval prompt, cached in ``path``."""
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("max_new_tokens") == max_new_tokens:
            return [Sample(**s) for s in data["samples"]]
    import torch

    from infra.prompts import load_humaneval, load_mtbench
    from serving.target import load_target

    target = load_target()
    tok, model = target.tokenizer, target.model
    items = load_mtbench() + load_humaneval()
    prompts = [item.token_ids(tok) for item in items]
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    outputs: list[list[int]] = [[] for _ in items]
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))  # similar lengths batch well
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx])  # [b, T]
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad, eos_token_id=eos,
            )
        for row, i in enumerate(idx):
            new = out[row, width:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            outputs[i] = new
        print(f"generated {start + len(idx)}/{len(order)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    samples = [
        Sample(item.id, item.domain or "default", item.category or "", p, o)
        for item, p, o in zip(items, prompts, outputs)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model": target.model_id, "max_new_tokens": max_new_tokens,
        "samples": [s.__dict__ for s in samples],
    }))
    return samples


def split(samples: list[Sample], domain: str, every: int = 4) -> tuple[list[Sample], list[Sample]]:
    """(warm-up, held-out): every ``every``-th prompt of the domain is held out."""
    items = [s for s in samples if s.domain == domain]
    held = items[every - 1 :: every]
    warm = [s for s in items if s not in held]
    return warm, held


def greedy_accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            break
        n += 1
    return n


@dataclass
class SimResult:
    verify_steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    update_ms: float = 0.0
    calibration: list[tuple] | None = None
    """(source, matched, position in draft, confidence, accepted, count, total) per drafted token
    up to and including the first rejection."""

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / max(self.verify_steps, 1)

    def line(self, name: str) -> str:
        return (
            f"{name:<34} tokens/verify {self.tokens_per_verify:.3f}  acceptance "
            f"{self.accepted / max(self.drafted, 1):.3f}  drafted/step {self.drafted / max(self.verify_steps, 1):.2f}"
            f"  propose {self.draft_ms / max(self.verify_steps, 1):.3f} ms/step"
            f"  update {self.update_ms / max(self.verify_steps, 1):.3f} ms/step"
        )


def tree_accepted(tokens: list[int], parents: list[int], target: list[int]) -> int:
    """Accepted nodes of a token tree (parent indices, -1 = root) against the target's greedy
    continuation: the longest root path spelling a prefix of ``target``."""
    node, acc = -1, 0
    while acc < len(target):
        kids = [i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == target[acc]]
        if not kids:
            break
        node, acc = kids[0], acc + 1
    return acc


def simulate(drafter, held: list[Sample], k: int, tenant: str = "sim", online: bool = False) -> SimResult:
    """Greedy speculative decoding of the held-out samples, replayed against their target outputs.

    The first output token comes from prefill (no draft); every later token is emitted by a verify
    step: accepted drafts + the target's own next token. ``online``: finished outputs feed the
    index, as in serving."""
    from serving.drafters.base import DraftRequestView

    res = SimResult(calibration=[])
    for n, s in enumerate(held):
        out = s.output_ids
        view = DraftRequestView(f"held-{n}", s.prompt_ids + out[:1], len(s.prompt_ids), tenant)
        drafter.add_request(view)
        pos = 1
        while pos < len(out):
            t0 = time.perf_counter()
            prop = drafter.propose([view], k)
            res.draft_ms += (time.perf_counter() - t0) * 1e3
            m = int(prop.lengths[0])
            draft = prop.tokens[0, :m].tolist()
            if prop.parents is None:
                acc = greedy_accepted(draft, out[pos:])
            else:  # a token tree: follow the branch that the target's continuation takes
                acc = tree_accepted(draft, prop.parents[0, :m].tolist(), out[pos:])
            if drafter.last_drafts and drafter.last_drafts[0].parents is None:
                d = drafter.last_drafts[0]
                for j in range(min(m, acc + 1)):
                    st = d.steps[j]
                    res.calibration.append(
                        (d.source, d.matched, j, float(prop.confidence[0, j]), j < acc, st.count, st.total)
                    )
            commit = out[pos : pos + acc + 1]
            res.verify_steps += 1
            res.drafted += m
            res.accepted += acc
            res.emitted += len(commit)
            pos += len(commit)
            view.token_ids = view.token_ids + commit
            t0 = time.perf_counter()
            drafter.on_verified(view.request_id, commit, None)
            res.update_ms += (time.perf_counter() - t0) * 1e3
        drafter.remove_request(view.request_id, out if online else None)
    return res


def calibration_table(rows) -> str:
    """Mean confidence vs observed acceptance, by confidence bin and source."""
    import numpy as np

    lines = [f"{'source':<8}{'conf bin':<12}{'n':>7}{'mean conf':>11}{'accepted':>10}"]
    edges = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.01]
    for src in ("context", "index"):
        sel = [(r[3], r[4]) for r in rows if r[0] == src]
        if not sel:
            continue
        conf = np.array([c for c, _ in sel])
        acc = np.array([a for _, a in sel], dtype=float)
        for lo, hi in itertools.pairwise(edges):
            m = (conf >= lo) & (conf < hi)
            if m.sum():
                lines.append(f"{src:<8}{f'{lo:.1f}-{min(hi, 1):.1f}':<12}{int(m.sum()):>7}"
                             f"{conf[m].mean():>11.3f}{acc[m].mean():>10.3f}")
    return "\n".join(lines)


def spliced_corpus(samples: list[Sample], n_tokens: int, seed: int = 0) -> list[list[int]]:
    """~n_tokens of distinct sequences with real local statistics: halves of two random outputs
    joined (repeating the real outputs would add nothing to an automaton)."""
    import random

    rng = random.Random(seed)
    outs = [s.output_ids for s in samples if len(s.output_ids) >= 16]
    seqs, total = [], 0
    while total < n_tokens:
        a, b = rng.choice(outs), rng.choice(outs)
        i, j = rng.randrange(len(a) // 2), rng.randrange(len(b) // 2)
        seq = a[i : i + 48] + b[j : j + 48]
        seqs.append(seq)
        total += len(seq)
    return seqs


def speed(samples: list[Sample], k: int, sizes=(5_000, 50_000, 200_000)) -> None:
    """Per-step propose and update time against indexes of growing size (built from spliced
    warm-up outputs; the index keeps between 3/4 of its budget and all of it)."""
    from serving.drafters.suffix import SuffixConfig, SuffixDrafter

    warm, held = split(samples, "chat")
    warm_code, held_code = split(samples, "code")
    for n in sizes:
        d = SuffixDrafter(SuffixConfig(max_index_tokens=n))
        t0 = time.perf_counter()
        for seq in spliced_corpus(warm + warm_code, n):
            d.observe("sim", seq)
        build = time.perf_counter() - t0
        idx = d.index("sim")
        res = simulate(d, held + held_code, k)
        print(f"index {idx.num_tokens:>7} tokens {idx.num_states:>7} states "
              f"(built at {build / idx.num_tokens * 1e6:.1f} us/token): " + res.line("").strip())


def main() -> None:
    from serving.drafters.suffix import SuffixConfig, SuffixDrafter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--every", type=int, default=4, help="hold out every n-th prompt of a domain")
    ap.add_argument("--calibration", action="store_true", help="print confidence calibration tables")
    ap.add_argument("--speed", action="store_true", help="time lookups against growing indexes")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="SuffixConfig override, e.g. --set min_confidence=0.2 (repeatable)")
    args = ap.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    samples = generate_samples(args.cache, args.max_new_tokens)
    print(f"{len(samples)} samples, k={args.k}, overrides={overrides or '{}'}")
    if args.speed:
        speed(samples, args.k)
        return
    for domain in ("chat", "code"):
        warm, held = split(samples, domain, args.every)
        print(f"-- {domain}: warm-up {len(warm)} prompts ({sum(len(s.output_ids) for s in warm)} output "
              f"tokens), held-out {len(held)}")
        cold = SuffixDrafter(SuffixConfig(**overrides))
        print(simulate(cold, held, args.k).line("day 0 (prompt lookup only)"))
        print(simulate(SuffixDrafter(SuffixConfig(**overrides)), held, args.k, online=True)
              .line("day 0, held-out outputs fed online"))
        warmed = SuffixDrafter(SuffixConfig(**overrides))
        for s in warm:
            warmed.observe("sim", s.output_ids, prompt_ids=s.prompt_ids)
        res = simulate(warmed, held, args.k)
        print(res.line("index warmed on the warm-up set"))
        if args.calibration:
            print(calibration_table(res.calibration))


if __name__ == "__main__":
    main()
