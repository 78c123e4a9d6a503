"""`specrun bench`: validation, the Spec-Bench loader, the JSON schema, mismatch flags, the HTML report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specrun.bench.suite import BUILTIN_SUITE, PromptFileError, categories, load_jsonl, select
from specrun.cli.app import app

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH = REPO_ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
SPEC_BENCH_CATEGORIES = 13


def run_cli(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


# ---- prompts ----------------------------------------------------------------------


def test_builtin_suite_covers_the_issue_categories():
    assert categories(BUILTIN_SUITE) == ["code-completion", "code-editing", "chat", "summarisation", "qa", "rewriting"]
    assert len({p.prompt_id for p in BUILTIN_SUITE}) == len(BUILTIN_SUITE)
    edits = [p.text for p in BUILTIN_SUITE if p.category == "code-editing"]
    assert all("```python\n" in text and "def " in text for text in edits)  # the code is in the prompt


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason=f"Spec-Bench prompts not found at {SPEC_BENCH}")
def test_spec_bench_loader_reads_every_prompt_and_category():
    prompts = load_jsonl(SPEC_BENCH)
    assert len(prompts) == 480
    assert len(categories(prompts)) == SPEC_BENCH_CATEGORIES
    first = json.loads(SPEC_BENCH.read_text(encoding="utf-8").splitlines()[0])
    assert prompts[0].text == first["turns"][0]
    assert prompts[0].prompt_id == str(first["question_id"])
    two_each = select(prompts, ["summarization", "rag"], per_category=2)
    assert [p.category for p in two_each] == ["summarization", "summarization", "rag", "rag"]


def test_malformed_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n\n{"turns": [}\n')
    with pytest.raises(PromptFileError, match=r"prompts\.jsonl line 3: not valid JSON"):
        load_jsonl(path)
    path.write_text('{"question_id": 1, "category": "qa", "turns": []}\n')
    with pytest.raises(PromptFileError, match="line 1: 'turns' must be a non-empty list"):
        load_jsonl(path)


def test_a_prompt_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question_id": 1, "category": "qa", "turns": ["Hi?"]}\n')
    assert [prompt.text for prompt in load_jsonl(path)] == ["Hi?"]


def test_a_fifo_as_the_prompt_file_is_refused_without_waiting_for_a_writer(tmp_path):
    """It was read for ever (issue 56: special files are refused before reading)."""
    import os

    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    result = run_cli("--prompts", str(fifo))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == (f"error: cannot use the prompt file {fifo}: it is not a regular file; "
                                     "pass an existing JSONL file")


def test_a_report_to_stdout_is_a_usage_error(tmp_path, monkeypatch):
    """--report - wrote an HTML file named "-" in the working folder ("-" is stdout for --json)."""
    monkeypatch.chdir(tmp_path)
    result = run_cli("--report", "-")
    assert result.exit_code == 2 and "--report writes an HTML file" in result.stderr, result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot use the prompt file"),
        ('{"turns": ["ok"]}\n[1, 2]\n', "line 2: expected a JSON object"),
        ("\n\n", "holds no prompts"),
        # internal errors ending in Python's advice (sys.set_int_max_str_digits) or a RecursionError
        ('{"turns": ["ok"], "question_id": ' + "9" * 5000 + "}\n", "a number in it has thousands of digits"),
        ("[" * 100_000 + "\n", "line 1: not valid JSON (it nests too deeply)"),
        (b'{"turns": ["caf\xe9"]}\n', "it is not UTF-8 text (byte 16 is 0xe9); save it as UTF-8"),  # Latin-1
        # half a surrogate pair alone: an internal error at the first prompt, or after the run in --report
        ('{"turns": ["\\ud800"]}\n', "line 1: 'turns' holds a lone surrogate"),
        ('{"turns": ["ok"], "category": "a\\udfffb"}\n', "line 1: 'category' holds a lone surrogate"),
    ],
)
def test_bad_prompt_files_exit_1_with_one_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    result = run_cli("--prompts", str(path))
    assert result.exit_code == 1, result.output
    assert message in result.stderr and str(path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "none,warp"], "unknown method 'warp'"),
        (["--methods", ","], "--methods is empty"),
        (["--methods", "none,,draft"], "--methods 'none,,draft' has an empty name (two commas together"),
        (["--methods", "none,draft,"], "has an empty name (two commas together, or one at an end)"),
        (["--categories", " , "], "--categories is empty"),
        (["--categories", "chat,,qa"], "--categories 'chat,,qa' has an empty name"),
        (["--draft-len", "3", "--sweep-draft-len", "1..4"], "exclude each other"),
        (["--sweep-draft-len", "4..x"], "is not A..B or A,B,C"),
        (["--sweep-draft-len", "0..3"], "from 1 to"),
        (["--sweep-draft-len", "8..1"], "'8..1' runs backwards; e.g. --sweep-draft-len 1..8"),
        (["--sweep-draft-len", "0..-3"], "from 1 to"),  # backwards, and no range either way
        (["--sweep-draft-len", "1..1000000000000"], "from 1 to"),  # refused before the range is built
        (["--methods", "none,auto", "--sweep-draft-len", "1..3"], "needs a method with a fixed draft length"),
        (["--draft-len", "0"], "--draft-len must be between"),
        (["--draft-min-prob", "-0.1"], "--draft-min-prob must be between"),
        (["--repeat", "0"], "--repeat must be between"),
        (["-n", "0"], "--max-tokens must be between"),
        (["--temp", "-1"], "--temp must be between"),
        (["--suite", "other"], "unknown suite 'other'"),
        (["--suite", "builtin", "--prompts", "x.jsonl"], "exclude each other"),
        (["--categories", "poetry"], "unknown category 'poetry'"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
        (["--json", f"{__file__}/out.json"], "test_bench.py is a file, not a folder"),
        (["--report", "/"], "is a folder"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, message):
    result = run_cli(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_draft_method_without_a_draft_model_is_refused(tiny_llama):
    result = run_cli("-t", str(tiny_llama.gguf_path), "--methods", "none,draft")
    assert result.exit_code == 2
    assert "method 'draft' needs a draft model" in result.stderr


# ---- a real bench on the tiny models ------------------------------------------------

needs_llama = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


@pytest.fixture(scope="module")
def bench_outputs(tiny_llama, tmp_path_factory) -> dict:
    """One small sweep bench with draft == target (every draft accepted): its JSON, report and table."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    folder = tmp_path_factory.mktemp("bench")
    path = str(tiny_llama.gguf_path)
    result = run_cli(
        "-t", path, "-d", path, "--methods", "none,draft,lookup", "--categories", "code-completion,chat",
        "--per-category", "1", "-n", "8", "--sweep-draft-len", "1..2", "--repeat", "2",
        "--json", str(folder / "bench.json"), "--report", str(folder / "bench.html"),
    )
    assert result.exit_code == 0, result.output
    return {
        "json": json.loads((folder / "bench.json").read_text()),
        "report": folder / "bench.html",
        "stdout": result.stdout,
        "folder": folder,
    }


MEASURED_WHEN_LOSSY = (int, float, type(None))  # a lossy rule's quality figures: null for exact runs
FIGURES_KEYS = {
    "variant": str, "method": str, "draft_len": int, "prompts": int, "tokens": int, "seconds": float,
    "tokens_per_second": float, "median_tokens_per_second": float, "speedup": float, "acceptance_rate": float,
    "mean_tokens_per_step": float, "draft_share": float, "verify_share": float, "mismatches": int, "near_ties": int,
    "agreement": MEASURED_WHEN_LOSSY, "log_likelihood": MEASURED_WHEN_LOSSY,
}
STATS_KEYS = {
    "method": str, "drafters": str, "draft_len": int, "adaptive": bool, "draft_min_prob": float, "prompt_tokens": int, "new_tokens": int,
    "steps": int, "drafted": int, "accepted": int, "acceptance_rate": float, "mean_tokens_per_step": float, "accepted_hist": list,
    "by_source": dict, "tokens_per_second": float, "prefill_seconds": float, "draft_seconds": float, "verify_seconds": float,
    "generation_seconds": float, "near_ties": int, "acceptance": str, "threads": (dict, type(None)),
}


def assert_keys(record: dict, expected: dict[str, type]) -> None:
    assert set(record) == set(expected), set(record) ^ set(expected)
    for key, kind in expected.items():
        allowed = (int, float) if kind is float else kind  # JSON writes 1.0 as 1.0 but 0 may come back an int
        assert isinstance(record[key], allowed) and isinstance(record[key], bool) == (kind is bool), (key, record[key])


def test_json_holds_every_figure_and_the_machine(bench_outputs):
    doc = bench_outputs["json"]
    assert list(doc) == [
        "schema", "started_at", "wall_seconds", "config", "machine", "prompts", "skipped", "runs",
        "per_prompt", "per_category", "overall", "accepted_hist", "sweep", "mismatches",
    ]
    assert doc["schema"] == "specrun.bench/1"
    config = doc["config"]
    assert config["methods"] == ["none", "draft", "lookup"] and config["draft_lens"] == [1, 2] and config["sweep"]
    assert config["draft_min_prob"] == 0.0
    assert config["tuned"] is None and config["tuned_by"] is None  # no stored settings in the tests' own config
    assert [v["name"] for v in config["variants"]] == ["none", "draft k=1", "draft k=2", "lookup k=1", "lookup k=2"]
    assert config["repeat"] == 2 and config["max_new_tokens"] == 8 and config["baseline"] == "none"
    assert config["flash_attn"] in ("on", "off")  # measured: the suite's llama.cpp runs on a CPU (sessions/kernels.py)
    assert (config["verify"], config["acceptance"], config["acceptance_settings"]) == ("block", "exact", None)

    machine = doc["machine"]
    assert set(machine) == {"cpu", "cores", "gpu", "os", "backend", "threads", "versions"}
    assert isinstance(machine["cpu"], str) and isinstance(machine["cores"], int) and machine["backend"] == "llama"
    assert set(machine["versions"]) == {"specrun", "llama-cpp-python", "mlx", "mlx-lm", "numpy", "python"}
    assert machine["versions"]["llama-cpp-python"] == importlib.metadata.version("llama-cpp-python")

    assert [(p["index"], p["category"]) for p in doc["prompts"]] == [(0, "code-completion"), (1, "chat")]
    assert len(doc["runs"]) == 2 * 5 * 2  # prompts × variants × repeats
    for run in doc["runs"]:
        assert set(run) == {"prompt_index", "variant", "repeat", "finish_reason", "same_as_baseline", "stats"}
        assert run["same_as_baseline"] is True
        assert_keys(run["stats"], STATS_KEYS)
        assert run["stats"]["acceptance"] == "exact"
        assert sum(source["steps"] for source in run["stats"]["by_source"].values()) == run["stats"]["steps"]
    assert len(doc["per_prompt"]) == 2 * 5
    for row in doc["per_prompt"]:
        assert_keys({k: v for k, v in row.items() if k != "prompt_index"}, FIGURES_KEYS)
    assert list(doc["per_category"]) == ["code-completion", "chat"]
    for row in [*doc["overall"], *(row for rows in doc["per_category"].values() for row in rows)]:
        assert_keys(row, FIGURES_KEYS)
    assert [row["prompts"] for row in doc["overall"]] == [2] * 5
    assert all(row["agreement"] is None and row["log_likelihood"] is None for row in doc["overall"])

    overall = {row["variant"]: row for row in doc["overall"]}
    assert overall["none"]["speedup"] == 1.0 and overall["none"]["mean_tokens_per_step"] == 1.0
    assert overall["draft k=2"]["acceptance_rate"] == 1.0  # draft == target
    assert overall["draft k=2"]["mean_tokens_per_step"] >= 2.0  # 8 tokens: the prefill one, then 3 + 3 + 1
    assert sum(doc["accepted_hist"]["draft k=2"][1:]) > 0
    assert [point["draft_len"] for point in doc["sweep"]["draft"]] == [1, 2]
    assert doc["mismatches"] == []


def test_table_per_category_with_geomean(bench_outputs):
    table = bench_outputs["stdout"]
    for heading in ("code-completion (1 prompt)", "chat (1 prompt)", "all 2 prompts: geometric-mean speed-up"):
        assert heading in table
    for column in ("tok/s", "speed-up", "accepted", "tokens/step", "draft/verify", "same output"):
        assert column in table
    assert "draft k=2" in table and "100%" in table
    assert "NO" not in table


@needs_llama
def test_a_wrong_verifier_is_flagged_as_a_real_mismatch(tiny_llama, tiny_qwen2, tmp_path, monkeypatch):
    from specrun.verify import Verdict

    def accept_every_draft(draft_tokens, target_argmax):
        return Verdict(len(draft_tokens), int(target_argmax[len(draft_tokens)]))

    # Plain decoding drafts nothing, so only the speculative method goes wrong.
    monkeypatch.setattr("specrun.engine.passes.verify_greedy", accept_every_draft)
    out = tmp_path / "bench.json"
    result = run_cli(
        "-t", str(tiny_llama.gguf_path), "-d", str(tiny_qwen2.gguf_path), "--methods", "none,draft",
        "--categories", "code-completion", "--per-category", "1", "-n", "12", "-k", "4",
        "--json", str(out),  # -k 4: drafted every step (an adaptive run may judge drafting too dear)
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [(m["variant"], m["near_tie"]) for m in doc["mismatches"]] == [("draft", False)]
    assert doc["mismatches"][0]["top2_gap"] >= 1e-3
    draft_row = next(row for row in doc["overall"] if row["variant"] == "draft")
    assert draft_row["mismatches"] == 1
    assert [run["same_as_baseline"] for run in doc["runs"] if run["variant"] == "draft"] == [False]
    table_row = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["draft"])
    assert "NO: 1 prompt" in table_row


@needs_llama
def test_a_sampled_bench_runs_with_every_sampling_option(tiny_llama, tiny_qwen2, tmp_path):
    """--top-k/--top-p/--min-p reach the runs: each at its narrowest (top-k 1, top-p 0.01, min-p 0.99)
    makes a sampled run greedy decoding, step for step (a disagreeing draft model at a fixed length
    drafts and keeps what the greedy run does), where the same seed without them samples another
    text; the JSON, the table's footnote and the trace's header say what was sampled."""
    path, draft = str(tiny_llama.gguf_path), str(tiny_qwen2.gguf_path)

    def bench(tag: str, *sampling: str) -> tuple[dict, str, dict]:
        out, trace = tmp_path / f"{tag}.json", tmp_path / f"{tag}.jsonl"
        result = run_cli("-t", path, "-d", draft, "--methods", "none,draft", "--categories", "code-editing",
                         "--per-category", "2", "-n", "16", "-k", "3", "--json", str(out), "--trace", str(trace),
                         *sampling)
        assert result.exit_code == 0, result.output
        notes = " ".join(result.stderr.split())  # the footnotes, on stderr (wrapped to the terminal)
        return json.loads(out.read_text()), notes, json.loads(trace.read_text().splitlines()[0])

    def steps(doc: dict) -> list[tuple]:
        return [(run["prompt_index"], run["variant"], run["stats"]["new_tokens"], run["stats"]["steps"],
                 run["stats"]["drafted"], run["stats"]["accepted"]) for run in doc["runs"]]

    greedy = steps(bench("greedy")[0])
    drafted = [(count, kept) for _, variant, _, _, count, kept in greedy if variant == "draft"]
    assert all(count > 0 for count, _ in drafted) and any(kept < count for count, kept in drafted), drafted
    assert steps(bench("temp", "--temp", "1.5", "--seed", "3")[0]) != greedy
    for option, narrowest in (("--top-k", "1"), ("--top-p", "0.01"), ("--min-p", "0.99")):
        assert steps(bench(option, "--temp", "1.5", "--seed", "3", option, narrowest)[0]) == greedy, option

    doc, notes, header = bench("every", "--temp", "0.7", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05",
                               "--seed", "3")
    config = doc["config"]
    assert (config["temperature"], config["top_k"], config["top_p"], config["min_p"], config["seed"]) == (
        0.7, 40, 0.9, 0.05, 3)
    assert "temperature 0.7, top-k 40, top-p 0.9, min-p 0.05, seed 3; generation time only" in notes
    assert {k: header[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == {
        "temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 3}


@pytest.mark.parametrize(("args", "message"), [
    (["--top-k", "-1"], "--top-k must be 0 (off) or positive"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--min-p", "1"], "--min-p must be in [0, 1)"),
])
def test_bad_sampling_options_exit_2_with_one_line(args, message):
    result = run_cli("--temp", "0.7", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_footnote_never_rounds_an_option_into_another():
    """top-p 0.9999999 is on (it cuts the tail): the footnote must not print it as 1."""
    from specrun.sampling import SamplingSettings

    assert SamplingSettings(0.7, top_p=0.9999999, min_p=1e-7).describe() == (
        "temperature 0.7, top-p 0.9999999, min-p 1e-07")
    assert SamplingSettings(0.0, top_k=40, seed=1).describe() == "greedy"


# ---- the HTML report in a real browser -------------------------------------------------


def test_html_report_renders_its_charts_in_chromium(bench_outputs):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (make install adds Debian's chromium when run as root)")
    folder = bench_outputs["folder"]
    screenshot = folder / "report.png"
    done = subprocess.run(
        [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={folder / 'chromium-profile'}", "--dump-dom", f"--screenshot={screenshot}",
            "--window-size=1200,2000", bench_outputs["report"].as_uri(),
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    speedup, accepted, sweep = (svg_element(dom, f"chart-{name}") for name in ("speedup", "accepted", "sweep"))
    assert speedup.count('class="bar"') == 2 * 3  # draft and lookup (each at its best k) × 2 categories and all
    # one bar per charted variant (draft and lookup at their best k) per accepted count seen:
    # 0 and 1, and 2 when the best draft length is 2 (with draft == target, k = 1 and 2 near-tie)
    doc = bench_outputs["json"]
    best = {
        method: max((row for row in doc["overall"] if row["method"] == method), key=lambda row: row["speedup"])
        for method in ("draft", "lookup")
    }
    longest = max(len(doc["accepted_hist"][row["variant"]]) for row in best.values())
    assert longest >= 2
    assert accepted.count('class="bar"') == 2 * longest
    assert sweep.count('class="line"') == 2 and sweep.count('class="point"') == 2 * 2  # k = 1, 2
    assert 'class="reference"' in speedup and 'class="legend-key"' in sweep
    assert "<script" not in dom and "http://" not in dom.replace("http://www.w3.org/2000/svg", "")
    assert_not_blank(screenshot)


def svg_element(dom: str, element_id: str) -> str:
    """The text of the <svg> element with this id in the rendered DOM."""
    start = dom.index(f'<svg id="{element_id}"')
    return dom[start : dom.index("</svg>", start)]


def assert_not_blank(png: Path) -> None:
    """The screenshot shows a drawing, not one flat colour: exact pixels with PIL, else from the PNG's rows."""
    try:
        from PIL import Image
    except ImportError:
        return assert_png_rows_vary(png.read_bytes())
    with Image.open(png) as image:
        assert image.size == (1200, 2000)
        rgb = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(rgb, axis=0, return_counts=True)
    assert len(colours) > 16, "the screenshot is (nearly) a single colour"
    assert len(rgb) - counts.max() > 0.02 * len(rgb), "almost nothing was drawn on the background"


def assert_png_rows_vary(data: bytes) -> None:
    """Without PIL: in a one-colour PNG every filtered scanline is constant after its first pixel.

    (None repeats the colour; Sub, Up, Average and Paeth predict it exactly and leave
    zeros.) So rows whose filtered bytes vary prove that something was drawn there;
    decoding every pixel in pure Python would take many seconds.
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, header = 8, b"", None
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        chunk = data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        offset += 12 + length
    width, height, depth, colour_type, _, _, interlace = header
    assert (width, height) == (1200, 2000)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, header
    channels = 3 if colour_type == 2 else 4
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * channels)
    after_first_pixel = rows[:, 1 + channels :]  # (height, (width - 1) * channels)
    varying = (after_first_pixel != after_first_pixel[:, :1]).any(axis=1)  # (height,)
    assert varying.mean() > 0.05, f"only {varying.sum()} of {height} rows show anything: the screenshot is blank"


def test_settings_earlier_runs_learned_are_credited_to_them_not_to_tune(tmp_path, monkeypatch):
    """After generate alone (learned.json, no tuned.json) bench said its controllers started
    from `specrun tune`'s measurements."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    learned = CliRunner().invoke(app, ["generate", "-t", "demo-target", "-d", "demo-draft", "--method", "draft", "-n", "48",
                      "--threads", "1", "def parse(line):"])
    assert learned.exit_code == 0 and (tmp_path / "specrun" / "learned.json").is_file(), learned.output
    out = tmp_path / "bench.json"
    result = run_cli("-t", "demo-target", "-d", "demo-draft", "--methods", "none,draft", "-n", "8",
                     "--per-category", "1", "--categories", "chat", "--threads", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "controllers started from what earlier runs of this pair measured on this machine (learned.json)" in said
    assert "specrun tune`'s measurements" not in said
    config = json.loads(out.read_text())["config"]
    assert config["tuned"] and config["tuned_by"] == "earlier runs"


def test_a_bench_on_a_busy_machine_says_its_figures_are_of_one(tiny_llama, tmp_path, monkeypatch):
    """Other processes kept cores busy: llama.cpp's threads gave way (backends/cpu_load.py) and
    the footnotes say how many passes ran on fewer threads; the JSON's stats have the counts."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from tests.backends.test_cpu_load import two_cores_read_from

    two_cores_read_from(monkeypatch, others=1.0)  # a core held by another process all along
    out = tmp_path / "bench.json"
    path = str(tiny_llama.gguf_path)
    result = run_cli("-t", path, "--methods", "none,lookup", "--categories", "chat", "--per-category", "1",
                     "-n", "6", "--json", str(out))
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "other processes kept cores busy:" in said and "these figures are of a busy machine" in said
    for run in json.loads(out.read_text())["runs"]:
        threads = run["stats"]["threads"]
        assert threads["busy_passes"] == threads["passes"] > 0 and (threads["least"], threads["most"]) == (1, 2)
