"""auto drafts with the target's own heads where it has some (issue 29): which kind, where they
are found, what a file that cannot serve does, and the text staying plain decoding's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from heads_factory import oracle_eagle, oracle_heads, oracle_hydra, random_eagle, random_heads, random_hydra
from specrun.drafters.methods import (
    AUTO_HEADS_ORDER,
    DrafterOptions,
    auto_heads_kind,
    build_drafter,
    check_method,
    resolve_method,
)
from specrun.modelkit.heads import save_heads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from cli_checks import assert_one_line_error, invoke  # noqa: E402

MADE = {"medusa": random_heads, "hydra": random_hydra, "eagle": random_eagle}


# ---- the chain auto resolves to ---------------------------------------------------------------

@pytest.mark.parametrize("heads, has_draft, lookahead, chain", [
    ("eagle", True, False, "lookup+ngram+eagle+draft"),
    ("medusa", False, False, "lookup+ngram+medusa"),
    ("hydra", True, True, "lookup+ngram+lookahead+hydra+draft"),
    (None, True, False, "lookup+ngram+draft"),
    (None, False, True, "lookup+ngram+lookahead"),
])
def test_auto_puts_the_heads_after_the_cheap_drafters_and_before_the_draft_model(heads, has_draft, lookahead, chain):
    assert resolve_method("auto", has_draft, lookahead, heads) == chain
    check_method(chain)  # a chain --method itself accepts: cheapest first, one kind of heads
    assert resolve_method("lookup+draft", has_draft, lookahead, heads) == "lookup+draft"  # named chains as named


def test_auto_takes_eagle_before_hydra_before_medusa():
    vocab = 32
    eagle, hydra, medusa = oracle_eagle(vocab), oracle_hydra(vocab), oracle_heads(vocab)
    assert AUTO_HEADS_ORDER == ("eagle", "hydra", "medusa")
    assert auto_heads_kind((medusa, hydra, eagle)) == "eagle"
    assert auto_heads_kind((medusa, hydra)) == "hydra"
    assert auto_heads_kind(medusa) == "medusa"
    assert auto_heads_kind(None) is None


def test_auto_with_heads_builds_the_chain_with_a_head_drafter():
    from fake_models import hashed_logits
    from specrun.backends.fake import FakeBackend

    draft = FakeBackend(hashed_logits(32, salt=2), 32)
    drafter = build_drafter("auto", draft, DrafterOptions(heads=(oracle_heads(32), oracle_eagle(32))))
    assert [member.name for member in drafter.members] == ["lookup", "ngram", "eagle", "draft"]
    without = build_drafter("auto", draft, DrafterOptions())
    assert [member.name for member in without.members] == ["lookup", "ngram", "draft"]


def test_auto_with_heads_drafts_with_them_on_the_fake_pair_and_keeps_plain_decoding_s_text():
    """The harness's "auto heads" scenario (tests/engine/test_acceptance.py samples it against the
    oracle's exact distribution): greedy here, the heads draft and the text is plain decoding's."""
    from lossless_harness import SCENARIOS, fake_engine
    from specrun.engine.loop import GenerationParams

    engine = fake_engine(SCENARIOS["auto heads"])
    params = GenerationParams(80, 16, stop_at_eos=False)
    result = engine.run([1, 2, 3], params)
    plain = fake_engine(SCENARIOS["none"]).run([1, 2, 3], GenerationParams(80, 0, stop_at_eos=False))
    assert result.token_ids == plain.token_ids
    assert result.stats.drafters == "lookup+ngram+eagle+draft"
    # Alone, or merged with the others' proposals into one tree ("eagle+draft+lookup", …).
    with_eagle = [counts for source, counts in result.stats.by_source.items() if "eagle" in source.split("+")]
    assert sum(counts.drafted for counts in with_eagle) > 0 and sum(counts.accepted for counts in with_eagle) > 0


def test_the_summary_line_says_what_auto_drafted_with():
    from specrun.engine.stats import Stats

    assert "method auto (lookup+ngram+eagle+draft)" in Stats(method="auto", drafters="lookup+ngram+eagle+draft").summary()
    named = Stats(method="lookup+draft", drafters="lookup+draft").summary()
    assert named.endswith("method lookup+draft")  # a chain named is not repeated


# ---- where auto finds its heads (a tiny llama.cpp target, heads beside the model file) --------

@pytest.fixture
def model(tiny_llama, tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_llama.gguf_path.read_bytes())
    return path


def beside(model: Path, kind: str, config, hidden_size: int | None = None) -> Path:
    path = model.with_suffix(f".{kind}.safetensors")
    save_heads(MADE[kind](hidden_size or config.hidden_size, config.vocab_size), path)
    return path


def auto_run(model: Path, *extra: str):
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "12", "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["stats"], result.stderr


@pytest.mark.parametrize("kinds, chosen", [
    (("eagle",), "eagle"), (("medusa",), "medusa"), (("medusa", "hydra"), "hydra"), (("medusa", "eagle"), "eagle"),
])
def test_auto_drafts_with_the_best_kind_of_heads_found_beside_the_model(model, tiny_llama, kinds, chosen):
    for kind in kinds:
        beside(model, kind, tiny_llama.config)
    stats, stderr = auto_run(model)
    assert stats["method"] == "auto" and stats["drafters"] == f"lookup+ngram+{chosen}"


def test_auto_without_heads_drafts_as_before(model):
    stats, stderr = auto_run(model)
    assert stats["drafters"] == "lookup+ngram" and "heads" not in stderr


def test_heads_found_for_another_model_leave_auto_without_them_and_say_so(model, tiny_llama):
    path = beside(model, "eagle", tiny_llama.config, hidden_size=64)
    stats, stderr = auto_run(model)
    assert stats["drafters"] == "lookup+ngram"
    notes = [line for line in stderr.splitlines() if "auto drafts without heads" in line]
    assert len(notes) == 1 and str(path) in notes[0] and "64" in notes[0], stderr
    assert "Traceback" not in stderr


def test_auto_drafts_with_the_heads_file_given(model, tiny_llama, tmp_path):
    beside(model, "eagle", tiny_llama.config)
    given = tmp_path / "given.safetensors"
    save_heads(random_heads(tiny_llama.config.hidden_size, tiny_llama.config.vocab_size), given)
    stats, _ = auto_run(model, "--heads", str(given))
    assert stats["drafters"] == "lookup+ngram+medusa"  # --heads, not the eagle heads beside the model


def test_a_heads_file_given_that_cannot_serve_auto_is_one_line(model, tiny_llama, tmp_path):
    wrong = tmp_path / "wrong.safetensors"
    save_heads(random_eagle(64, tiny_llama.config.vocab_size), wrong)
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "4", "--heads", str(wrong))
    assert_one_line_error(result.exit_code, result.stderr, 1, "wrong.safetensors", "64",
                          str(tiny_llama.config.hidden_size))
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x00" * 16)
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", "auto", "-n", "4", "--heads", str(damaged))
    assert_one_line_error(result.exit_code, result.stderr, 1, "damaged.safetensors")


# ---- the demo target's shipped heads: auto's text stays plain decoding's -------------------

def test_auto_on_the_demo_target_drafts_with_its_shipped_eagle_heads_and_keeps_the_text():
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    args = ("generate", "def parse(line):", "-n", "48", "--backend", "llama", "--exact", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    result = invoke(*args, "-m", "auto")
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)
    assert auto["stats"]["drafters"] == "lookup+ngram+eagle+draft"
    assert auto["text"] == plain["text"]


def test_auto_with_heads_on_mlx_keeps_plain_decoding_s_text():
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    args = ("generate", "def parse(line):", "-n", "32", "--backend", "mlx", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    result = invoke(*args, "-m", "auto")
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)
    assert auto["stats"]["drafters"] == "lookup+ngram+eagle+draft"
    assert auto["text"] == plain["text"] or auto["stats"]["near_ties"] > 0


# ---- chat, bench ----------------------------------------------------------------------------

def test_a_chat_in_auto_drafts_with_the_heads_and_finds_them_again_after_another_method(model, tiny_llama):
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import open_chat

    beside(model, "hydra", tiny_llama.config)
    chain = ["lookup", "ngram", "hydra", "draft"]
    with open_chat(str(model), str(model), "auto", LoadOptions(backend="llama")) as session:
        assert [member.name for member in session.engine.drafter.members] == chain
        session.set_method("none")
        session.set_method("auto")
        assert [member.name for member in session.engine.drafter.members] == chain
    with open_chat(str(model), str(model), "none", LoadOptions(backend="llama")) as session:
        session.set_method("auto")  # a chat begun without a drafter finds them when auto is asked for
        assert [member.name for member in session.engine.drafter.members] == chain
        done = list(session.ask("def f(x):", GenerationParams(8, 4)))[-1]
        assert done.stats.drafters == "+".join(chain)


def test_bench_s_auto_line_drafts_with_the_heads_and_notes_it(model, tiny_llama):
    beside(model, "medusa", tiny_llama.config)
    result = invoke("bench", "-t", str(model), "--methods", "none,auto", "-n", "8", "--per-category", "1")
    assert result.exit_code == 0, result.output
    assert "auto drafts with the target's medusa heads too" in result.stderr + result.stdout


def test_a_comparison_tracks_hidden_states_only_for_the_lines_whose_drafters_read_them(tiny_llama):
    """Every line of a bench drives one target: the heads auto binds must not have the baseline
    (or any line without heads) pay for tracked passes."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.kv import sequence_for
    from specrun.backends.llama import LlamaCppBackend
    from specrun.engine.loop import GenerationParams
    from specrun.sessions.compare import Variant, compare_variants

    config = tiny_llama.config
    target = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=256, n_threads=1)
    try:
        seen = []
        variants = [Variant("none", "none", 0), Variant("auto", "auto", 4), Variant("lookup", "lookup", 4),
                    Variant("eagle", "eagle", 4)]
        compare_variants(target, None, [[1, 5, 9, 1, 5], [2, 7, 2, 7]], variants, GenerationParams(6),
                         drafter_options=DrafterOptions(heads=random_eagle(config.hidden_size, config.vocab_size)),
                         on_result=lambda index, name, result: seen.append((name, sequence_for(target).tracking)))
        assert seen == [(name, name in ("auto", "eagle")) for _ in range(2) for name in ("none", "auto", "lookup",
                                                                                          "eagle")]
        assert not sequence_for(target).tracking  # the drafters closed, tracking ends with them
    finally:
        target.close()
