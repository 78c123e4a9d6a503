"""The bench as one self-contained HTML file: charts drawn as inline SVG, tables, the machine.

Nothing is loaded from anywhere else (no scripts, fonts or images), so the file opens
offline and can be attached to an issue as it is.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from specrun.bench.figures import (
    ALL_PROMPTS,
    Figures,
    by_category,
    count_of,
    mismatch_rows,
    sweep_curve,
)
from specrun.bench.runner import BenchResult
from specrun.bench.svg import Series, bar_chart, colors, line_chart
from specrun.bench.tables import COLUMNS, footnotes, row_cells
from specrun.fileio import write_atomically

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 960px;
       color: #1a1a1a; background: #fff; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { padding: 0.25rem 0.7rem; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child, td.text { text-align: left; }
tr.mismatch td { color: #b00020; font-weight: bold; }
svg.chart { display: block; margin: 0.5rem 0 1.5rem; max-width: 100%; height: auto; }
svg text { font-family: inherit; font-size: 12px; fill: #1a1a1a; }
svg .chart-title { font-size: 15px; font-weight: bold; }
.note { color: #555; font-size: 0.85rem; }
"""


def write_html_report(result: BenchResult, path: Path) -> None:
    """Write the report to ``path`` (atomically: a full disk leaves the old file, not half a report)."""
    write_atomically(path, html_report(result), "report", through_special=True)


def html_report(result: BenchResult) -> str:
    """The whole report as one HTML document."""
    config = result.config
    title = f"specrun bench: {config.target} + {config.draft or 'no draft model'}"
    sections = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">{escape(result.started_at)} · {len(result.prompts)} prompts · '
        f"{escape(result.machine.get('cpu') or '')} · backend {escape(result.machine.get('backend') or '')}</p>",
        "<h2>Speed-up by category</h2>",
        speedup_chart(result),
        "<h2>Accepted draft tokens per verify pass</h2>",
        accepted_chart(result),
        "<h2>Draft length</h2>",
        sweep_chart(result),
        *_sweep_note(result),
        "<h2>Figures by category</h2>",
        *(_figures_table(result, category, rows) for category, rows in by_category(result).items()),
        *_mismatch_section(result),
        "<h2>Notes</h2>",
        "<ul>" + "".join(f"<li>{escape(note)}</li>" for note in footnotes(result)) + "</ul>",
        "<h2>Machine</h2>",
        _machine_table(result.machine),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def speedup_chart(result: BenchResult) -> str:
    """Geometric-mean speed-up of each charted variant, per category and over all prompts."""
    table = by_category(result)
    series = [
        Series(name, [_row(table[category], name).speedup for category in table], color)
        for name, color in _charted(result).items()
    ]
    return bar_chart(
        "chart-speedup", f"speed-up over plain decoding (geometric mean; dashed: 1×){_sweep_suffix(result)}",
        list(table), series, "speed-up (×)", reference=1.0,
    )


def accepted_chart(result: BenchResult) -> str:
    """Share of verify passes that accepted 0, 1, … drafted tokens, per charted variant."""
    figures = result.comparison.figures
    charted = _charted(result)
    longest = max((len(figures[name].accepted_hist) for name in charted), default=1)
    series = []
    for name, color in charted.items():
        hist = figures[name].accepted_hist + [0] * (longest - len(figures[name].accepted_hist))
        total = sum(hist) or 1
        series.append(Series(name, [count / total for count in hist], color))
    return bar_chart(
        "chart-accepted", f"verify passes by drafted tokens accepted{_sweep_suffix(result)}",
        [str(n) for n in range(longest)], series, "share of verify passes", value_format="{:.1%}",
    )


def sweep_chart(result: BenchResult) -> str:
    """Overall speed-up against draft length, one line per fixed-length method."""
    curves = sweep_curve(result)
    colours = method_colors(result)
    lengths = sorted({k for points in curves.values() for k, _ in points}) or sorted(
        {v.draft_len for v in result.comparison.variants.values()}
    )
    series = [
        Series(method, [dict(points).get(k, float("nan")) for k in lengths], colours[method])
        for method, points in curves.items()
    ]
    return line_chart(
        "chart-sweep", "speed-up over plain decoding by draft length (geometric mean over all prompts)",
        lengths, series, "draft length (tokens drafted per verify pass)", "speed-up (×)", reference=1.0,
    )


def method_colors(result: BenchResult) -> dict[str, str]:
    """One colour per speculative method, the same in every chart."""
    methods = [m for m in result.config.methods if m != result.comparison.baseline]
    return dict(zip(methods, colors(len(methods))))


def _charted(result: BenchResult) -> dict[str, str]:
    """The variants the bar charts show, with their colours: every speculative variant, or in a
    sweep each method at its fastest draft length (the sweep chart shows the others)."""
    comparison = result.comparison
    everything = range(len(result.prompts))
    by_method: dict[str, list[str]] = {}
    for name, variant in comparison.variants.items():
        if name != comparison.baseline:
            by_method.setdefault(variant.method, []).append(name)
    colours = method_colors(result)
    return {
        max(names, key=lambda name: comparison.geomean_speedup(name, everything)): colours[method]
        for method, names in by_method.items()
    }


def _sweep_suffix(result: BenchResult) -> str:
    return "; each method at its best draft length" if result.config.sweep else ""


def _sweep_note(result: BenchResult) -> list[str]:
    if result.config.sweep:
        return []
    return ['<p class="note">One draft length was measured; run with --sweep-draft-len 1..8 to draw the curve.</p>']


def _row(rows: list[Figures], variant: str) -> Figures:
    return next(f for f in rows if f.variant == variant)


def _figures_table(result: BenchResult, category: str, rows: list[Figures]) -> str:
    """The terminal table's rows as HTML; a real mismatch is marked red."""
    prompts = count_of(rows[0].prompts, "prompt")
    label = f"all {prompts}" if category == ALL_PROMPTS else f"{category} ({prompts})"
    head = "".join(f"<th>{escape(column)}</th>" for column in COLUMNS)
    body = []
    for figures in rows:
        cells = row_cells(result, figures)
        tds = "".join(f"<td>{escape(cell)}</td>" for cell in cells[:-1]) + f'<td class="text">{escape(cells[-1])}</td>'
        body.append(f'<tr class="{"mismatch" if figures.mismatches else ""}">{tds}</tr>')
    return f"<h3>{escape(label)}</h3>\n<table><tr>{head}</tr>{''.join(body)}</table>"


def _mismatch_section(result: BenchResult) -> list[str]:
    rows = mismatch_rows(result)
    if not rows:
        return []
    items = "".join(
        f'<tr class="{"mismatch" if m.is_defect(result.exact) else ""}"><td>{escape(variant)}</td>'
        f"<td>{escape(result.prompts[m.prompt_index].prompt_id)}</td><td>{m.position}</td>"
        f'<td class="text">{escape(repr(m.plain_text))}</td><td class="text">{escape(repr(m.other_text))}</td>'
        f"<td>{'–' if m.token_gap is None else f'{m.token_gap:.4g}'}</td><td>{m.top2_gap:.4g}</td>"
        f'<td>{m.batch_rounding:.4g}</td><td class="text">{m.verdict(result.exact)}</td></tr>'
        for variant, m in rows
    )
    return [
        "<h2>Outputs that differ from plain decoding</h2>",
        '<p class="note">Each at its first differing token: a near-tie is a gap rounding explains, a DEFECT one it '
        f"does not{' (under --exact, any difference)' if result.exact else ''}.</p>",
        "<table><tr><th>method</th><th>prompt</th><th>first differing token</th><th>plain's token</th>"
        "<th>method's token</th><th>logit gap between them</th><th>target's top-2 gap</th>"
        f"<th>batch rounding there</th><th>verdict</th></tr>{items}</table>",
    ]


def _machine_table(machine: dict) -> str:
    facts = {key: value for key, value in machine.items() if key != "versions"}
    facts.update({f"version of {name}": version for name, version in machine.get("versions", {}).items()})
    rows = "".join(
        f'<tr><td>{escape(str(key))}</td><td class="text">{escape(str(value))}</td></tr>'
        for key, value in facts.items()
    )
    return f"<table>{rows}</table>"
