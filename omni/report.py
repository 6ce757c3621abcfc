"""The results bundle's `report.html` (omni/results.py): one self-contained page, nothing
fetched from elsewhere. Images are base64 PNG data URIs; charts are inline SVG drawn here,
one per metric family (the part of a key before its first "/": reward, train, eval, ...),
each with a line per key of the family, steps on x and values on y (each chart its own
scale). No JavaScript."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

# Line colours, taken in turn by the keys of a chart (Tableau's ten).
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
WIDTH, HEIGHT, MARGIN = 360, 180, 36  # a chart's size in pixels, and room for its axis labels
THUMBNAIL = 256  # the longest side of an image on the page, in pixels

Series = Dict[str, List[Tuple[int, float]]]  # key -> [(step, value)], steps ascending

STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.charts, .grid { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; width: 200px; font-size: 12px; }
figure img { width: 200px; image-rendering: pixelated; }
.chart { font-size: 12px; }
"""


def families(history: Series) -> Dict[str, Series]:
    """The history's keys grouped by family (the part before the first "/"), in name order."""
    grouped: Dict[str, Series] = {}
    for key in sorted(history):
        grouped.setdefault(key.split("/")[0], {})[key] = history[key]
    return grouped


def png_data_uri(image) -> str:
    """A PIL image as a PNG data URI, shrunk to at most THUMBNAIL pixels on its longest side."""
    image = image.convert("RGB")
    if max(image.size) > THUMBNAIL:
        image = image.copy()
        image.thumbnail((THUMBNAIL, THUMBNAIL))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def fmt(value: Optional[float]) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.4g}"


def line_chart(title: str, series: Series) -> str:
    """One SVG chart: a polyline (and a dot per point) for each key of `series`, a legend."""
    points = [(s, v) for values in series.values() for s, v in values if math.isfinite(v)]
    steps = [s for s, _ in points] or [0]
    values = [v for _, v in points] or [0.0]
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def xy(step: float, value: float) -> str:
        return f"{MARGIN + (step - x0) / (x1 - x0) * plot_w:.1f},{MARGIN + (y1 - value) / (y1 - y0) * plot_h:.1f}"

    parts = [
        f'<svg class="chart" width="{WIDTH}" height="{HEIGHT + 16 * len(series)}">',
        f'<text x="{MARGIN}" y="16" font-weight="bold">{html.escape(title)}</text>',
        f'<rect x="{MARGIN}" y="{MARGIN}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>',
        f'<text x="2" y="{MARGIN + 4}">{fmt(y1)}</text>',
        f'<text x="2" y="{MARGIN + plot_h}">{fmt(y0)}</text>',
        f'<text x="{MARGIN}" y="{MARGIN + plot_h + 14}">step {x0:g}</text>',
        f'<text x="{MARGIN + plot_w}" y="{MARGIN + plot_h + 14}" text-anchor="end">{x1:g}</text>',
    ]
    for index, (key, values) in enumerate(series.items()):
        colour = PALETTE[index % len(PALETTE)]
        finite = [(s, v) for s, v in values if math.isfinite(v)]
        coordinates = " ".join(xy(s, v) for s, v in finite)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coordinates}"/>')
        parts += [f'<circle cx="{c.split(",")[0]}" cy="{c.split(",")[1]}" r="2" fill="{colour}"/>'
                  for c in coordinates.split()]  # fmt: skip
        last = fmt(finite[-1][1]) if finite else "n/a"
        parts.append(
            f'<text x="{MARGIN}" y="{HEIGHT + 16 * index + 4}" fill="{colour}">{html.escape(key)} (last {last})</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def headline_table(headline: Mapping[str, Optional[float]]) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{fmt(v)}</td></tr>" for k, v in headline.items())
    return f"<table>{rows}</table>"


def category_table(per_category: Mapping[str, Mapping[str, float]]) -> str:
    if not per_category:
        return "<p>The held-out prompts carry no category tag.</p>"
    rows = "".join(
        f"<tr><td>{html.escape(tag)}</td><td>{fmt(row['mean'])}</td><td>{int(row['n'])}</td></tr>"
        for tag, row in per_category.items()
    )
    return f"<table><tr><th>category</th><th>mean reward</th><th>images</th></tr>{rows}</table>"


def image_grid(images: Sequence[Tuple[object, str]]) -> str:
    figures = "".join(
        f'<figure><img src="{png_data_uri(image)}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for image, caption in images
    )
    return f'<div class="grid">{figures}</div>' if images else "<p>No images.</p>"


def render(
    title: str,
    headline: Mapping[str, Optional[float]],
    per_category: Mapping[str, Mapping[str, float]],
    history: Series,
    images: Sequence[Tuple[object, str]],
) -> str:
    """The page: headline figures, the per-category table, a chart per metric family, the images."""
    charts = "\n".join(line_chart(name, series) for name, series in families(history).items())
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<h2>Headline</h2>
{headline_table(headline)}
<h2>Final evaluation by category</h2>
{category_table(per_category)}
<h2>Metrics over steps</h2>
<div class="charts">{charts or "<p>No metrics were logged.</p>"}</div>
<h2>Held-out images of the final evaluation</h2>
{image_grid(images)}
</body></html>
"""
