"""The suffix seed written from the target's own answers (infra/suffix_seed.py), and served: a
seeded suffix drafter drafts a new tenant's first request from it, losslessly."""

import asyncio

import pytest
import torch

from feedback.suffix.draft import SuffixConfig
from feedback.suffix.seed import SuffixSeed, SuffixSeedError, read_seed, write_seed
from feedback.target.fingerprint import TargetFingerprint
from infra.offline_generation import serve_traces
from infra.suffix_seed import SEED_ENV, ensure_suffix_seed, use_suffix_seed
from serving.drafters.factory import build_drafter
from serving.engine.config import EngineConfig
from serving.engine.torch_engine import TorchEngine
from serving.target import tiny_target
from trainer.offline import chat_ids
from trainer.package_prompts import package_requests

TOKENS = 10


@pytest.fixture(scope="module")
def target():
    """A tiny target whose greedy answers walk a random function of the last token (a randomly
    initialised one mostly repeats a token, which any index predicts)."""
    t = tiny_target(num_layers=2, seed=5)
    m = t.model
    with torch.no_grad():
        for layer in m.model.layers:  # the last hidden state is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.nn.Linear(m.config.hidden_size, m.config.vocab_size, bias=False)
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)))
    m.lm_head = head  # untied
    return t


@pytest.fixture(scope="module")
def built(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    path = ensure_suffix_seed(target, 2, max_new_tokens=TOKENS, cache_dir=root / "seeds", answers_cache=root / "answers")
    return root, path


def _prompts(target):
    return [chat_ids(target.tokenizer, r.messages) for r in package_requests(2, seed=0)]


def test_the_seed_holds_the_targets_greedy_answers_to_package_requests(target, built):
    _, path = built
    seed = read_seed(path, target.fingerprint)
    answers = serve_traces(target, _prompts(target), max_new_tokens=TOKENS)
    assert seed.sequences == [a.output_ids.tolist() for a in answers]
    assert len(seed.sequences) == 4 and "2 code + 2 chat" in seed.source


def test_answers_are_served_from_inside_a_running_event_loop(target):
    """``bench spec`` builds the seed inside its own event loop on a machine without a cached one
    (it failed there: asyncio.run() cannot be called from a running event loop)."""
    async def inside_a_loop():
        return serve_traces(target, _prompts(target), max_new_tokens=TOKENS)

    answers = asyncio.run(inside_a_loop())
    assert [a.output_ids.tolist() for a in answers] == [
        a.output_ids.tolist() for a in serve_traces(target, _prompts(target), max_new_tokens=TOKENS)]
    assert all(len(a.output_ids) == TOKENS for a in answers)


def test_a_written_seed_is_read_back_not_answered_again(target, built, monkeypatch):
    root, path = built
    import infra.offline_generation

    def no(*a, **k):
        raise AssertionError("answered again")

    monkeypatch.setattr(infra.offline_generation, "engine_generator", no)
    assert ensure_suffix_seed(target, 2, max_new_tokens=TOKENS, cache_dir=root / "seeds") == path
    # another recipe finds the answers it shares in the answers cache... or answers: here, none cached
    with pytest.raises(AssertionError, match="answered again"):
        ensure_suffix_seed(target, 2, max_new_tokens=TOKENS + 1, cache_dir=root / "seeds",
                           answers_cache=root / "answers")


def test_a_broken_seed_in_the_cache_is_written_again(target, built, tmp_path):
    root, path = built
    cache = tmp_path / "seeds"
    cache.mkdir()
    broken = cache / path.name
    broken.write_text(path.read_text()[:100])  # cut short
    again = ensure_suffix_seed(target, 2, max_new_tokens=TOKENS, cache_dir=cache, answers_cache=root / "answers")
    assert again == broken and read_seed(again).sequences == read_seed(path).sequences


def test_another_targets_seed_is_refused_by_the_builder_and_by_serving(target, tmp_path, monkeypatch):
    other = TargetFingerprint(model_id="other", tokenizer_hash="f" * 16, vocab_size=target.fingerprint.vocab_size)
    path = write_seed(tmp_path / "other.json", SuffixSeed(fingerprint=other, source="x", sequences=[[1, 2, 3]]))
    with pytest.raises(SuffixSeedError, match="not by the target served"):
        ensure_suffix_seed(target, 2, out=path)
    monkeypatch.setenv(SEED_ENV, str(path))
    with pytest.raises(SuffixSeedError, match="not by the target served"):
        build_drafter("suffix", target)
    with pytest.raises(SuffixSeedError, match="not by the target served"):
        build_drafter("hybrid", target, learned="standalone", learned_options={"draft_vocab_size": 512})


def test_use_suffix_seed_points_every_suffix_setting_at_the_file_and_zero_clears_it(target, built, monkeypatch):
    root, path = built
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert use_suffix_seed(target, 2, max_new_tokens=TOKENS, cache_dir=root / "seeds") == path
    assert SuffixConfig().seed_file == path
    assert use_suffix_seed(target, 0) is None
    assert SuffixConfig().seed_file is None


def _serve(target, drafter, prompts):
    from benchmarks.runner import run_prompts

    async def main():
        engine = TorchEngine(target, drafter, EngineConfig(k=4 if drafter else 0, max_batch_size=2, prefix_cache_tokens=0))
        await engine.start()
        try:
            return await run_prompts(engine, prompts, TOKENS, tenant="fresh-tenant")
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_a_seeded_suffix_drafter_drafts_a_new_tenants_first_requests_losslessly(target, built, monkeypatch):
    _, path = built
    prompts = _prompts(target)[:1]  # the target answers it as it did when the seed was written
    plain = _serve(target, None, prompts)
    assert len(set(plain.outputs[0])) > TOKENS // 2  # an answer worth predicting
    monkeypatch.delenv(SEED_ENV, raising=False)
    cold = _serve(target, build_drafter("suffix", target, use_prompt_lookup=False), prompts)
    monkeypatch.setenv(SEED_ENV, str(path))
    seeded = _serve(target, build_drafter("suffix", target, use_prompt_lookup=False), prompts)
    assert seeded.outputs == plain.outputs == cold.outputs  # lossless
    assert cold.accepted == 0  # an empty index, no prompt lookup: nothing to draft from
    assert seeded.accepted >= TOKENS // 2  # the seed holds this very answer


def test_specloop_up_starts_its_replicas_and_trainer_with_the_seed(target, built, monkeypatch):
    """``specloop up --suffix-seed N`` finds (or writes) the seed and hands its file to every
    process it starts (Topology's extra environment); 0 hands none."""
    from typer.testing import CliRunner

    import serving.target
    from infra import topology
    from infra.cli import app
    from infra.stack import ServiceStartError

    root, path = built
    started = []

    class Recorder:  # stands in for the processes: the wire under test ends at their environment
        def __init__(self, run_dir, replicas, model, extra_env, settings=None):
            started.append(extra_env)

        def up(self, say=None):
            raise ServiceStartError("not started in this test")

    monkeypatch.setattr(topology, "Topology", Recorder)
    monkeypatch.setattr(serving.target, "load_target", lambda model=None: target)
    monkeypatch.setattr(topology, "ensure_suffix_seed", lambda t, n: ensure_suffix_seed(
        t, n, max_new_tokens=TOKENS, cache_dir=root / "seeds", answers_cache=root / "answers"))
    result = CliRunner().invoke(app, ["up", "--suffix-seed", "2"])
    assert result.exit_code == 1 and started[-1] == {SEED_ENV: str(path)}
    CliRunner().invoke(app, ["up", "--suffix-seed", "0"])
    assert started[-1] == {}
