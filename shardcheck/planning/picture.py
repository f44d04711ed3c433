"""The plan as a picture: a self-contained HTML page with one inline SVG (no script, no
network), the condensed graph from top to bottom.

1. what every rank computes whole (by class, with the FLOPs it keeps whole);
2. the scatters before the first layer: which tensors, on which axis;
3. the layers, those of one form folded into one box with a count (a 96-layer model is one
   box): Q local or whole, the K/V (or Q) gathers, the scatters inside it, the bytes a rank
   receives, the share of its projections on slices;
4. the outputs gathered;
5. the plan figures: a bar per FLOPs class (on slices against whole), the speed-up bound, the
   peak activation memory per rank against one device; what keeps work whole.
"""

from __future__ import annotations

from html import escape

from shardcheck.planning.flop_count import CLASS_TITLES, CLASSES
from shardcheck.planning.plan import Plan
from shardcheck.planning.report import fold_layers, summary_line
from shardcheck.wording import counted, human

WIDTH = 1200
BOX_X = 40
BOX_WIDTH = WIDTH - 2 * BOX_X
SLICED = "#2e9e6b"
WHOLE = "#9aa0a6"
COLLECTIVE = "#3b6fd8"
MAX_FORMS = 6  # layer boxes drawn; more forms are counted in one line
MAX_NAMES = 3
MAX_NAME_CHARS = 36  # a tensor's name, cut from the left: its end says most


class _Canvas:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.y = 20

    def text(
        self,
        x: int,
        y: int,
        text: str,
        *,
        size: int = 15,
        weight: str = "normal",
        fill: str = "#202124",
        anchor: str = "start",
    ) -> None:
        self.parts.append(
            f'<text x="{x}" y="{y}" font-size="{size}" font-weight="{weight}" fill="{fill}" '
            f'text-anchor="{anchor}">{escape(text)}</text>'
        )

    def box(self, lines: list[str], *, fill: str, stroke: str, title: str, cls: str) -> None:
        height = 34 + 22 * len(lines)
        self.parts.append(
            f'<rect class="{cls}" x="{BOX_X}" y="{self.y}" width="{BOX_WIDTH}" '
            f'height="{height}" rx="10" fill="{fill}" stroke="{stroke}" stroke-width="3"/>'
        )
        self.text(BOX_X + 16, self.y + 24, title, size=17, weight="bold")
        for at, line in enumerate(lines):
            self.text(BOX_X + 16, self.y + 48 + 22 * at, line)
        self.y += height

    def arrow(self, label: str) -> None:
        x = BOX_X + 60
        top, bottom = self.y + 4, self.y + 44
        self.parts.append(
            f'<line x1="{x}" y1="{top}" x2="{x}" y2="{bottom - 8}" stroke="{COLLECTIVE}" '
            f'stroke-width="4"/><polygon points="{x - 9},{bottom - 10} {x + 9},{bottom - 10} '
            f'{x},{bottom}" fill="{COLLECTIVE}"/>'
        )
        self.text(x + 18, self.y + 30, label, size=14, fill=COLLECTIVE)
        self.y = bottom + 4

    def bar(self, label: str, share: float, note: str) -> None:
        left, width = BOX_X + 230, 560
        on = round(width * share)
        self.text(BOX_X, self.y + 17, label, size=15)
        self.parts.append(
            f'<rect x="{left}" y="{self.y}" width="{width}" height="22" fill="{WHOLE}"/>'
            f'<rect class="sliced" x="{left}" y="{self.y}" width="{on}" height="22" '
            f'fill="{SLICED}"/>'
        )
        self.text(left + width + 14, self.y + 17, note, size=14)
        self.y += 32


def _short(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else "..." + name[-(MAX_NAME_CHARS - 3) :]


def _names(tensors: list[str]) -> str:
    shown = ", ".join(_short(name) for name in tensors[:MAX_NAMES])
    more = len(tensors) - MAX_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _bytes(nbytes: int | None) -> str:
    return "?" if nbytes is None else human(nbytes)


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def render_svg(plan: Plan) -> str:
    canvas = _Canvas()
    canvas.text(BOX_X, canvas.y + 8, f"CP plan of {plan.model}", size=22, weight="bold")
    canvas.text(
        BOX_X,
        canvas.y + 34,
        f"length {plan.seq_len}, {counted(plan.ranks, 'rank')}: "
        f"{_percent(plan.flops_on_slices)} of FLOPs on slices, speed-up at most "
        f"{plan.speedup_bound:.2f}x; peak activations {human(plan.peak_bytes_per_rank)} per "
        f"rank against {human(plan.peak_bytes_one_device)} on one device",
        size=15,
    )
    canvas.y += 54

    whole_lines = [
        f"{CLASS_TITLES[name]}: {plan.classes[name].whole:,} FLOPs run whole, "
        f"{_percent(plan.classes[name].share_on_slices)} of the class on slices"
        for name in CLASSES
    ]
    canvas.box(
        whole_lines,
        fill="#f1f3f4",
        stroke=WHOLE,
        title="Computed whole on every rank (embeddings, position tables, masks, ...)",
        cls="whole",
    )
    before = [c for c in plan.collectives if c.role == "scatter" and c.layer in (0, None)]
    if before:
        axes = sorted({c.axis for c in before})
        canvas.arrow(
            f"reduce-scatter {counted(len(before), 'tensor')} on axis "
            f"{', '.join(map(str, axes))}: {_names([c.tensor for c in before])}"
        )
    groups = fold_layers(plan)
    starts = [0]
    for group in groups:
        starts.append(starts[-1] + len(group))
    for position, group in enumerate(groups[:MAX_FORMS]):
        first = group[0]
        gathers = [r for r in first.gathers if r.startswith("gather") and r != "gather output"]
        inside = first.gathers.count("scatter") if position or starts[position] else 0
        numbers = (
            f"layer {starts[position] + 1}"
            if len(group) == 1
            else f"layers {starts[position] + 1} to {starts[position] + len(group)}"
        )
        lines = [
            (
                "Q local: each rank's queries against every key"
                if first.q_local
                else "Q whole: every rank computes every query"
            ),
            (
                "K/V all-gathered"
                if {"gather K", "gather V"} <= set(gathers)
                else ", ".join(gathers) or "nothing gathered"
            )
            + (f"; {counted(inside, 'scatter')} inside the layer" if inside else ""),
            f"each rank receives {_bytes(first.bytes_received)} per layer; projections and "
            f"MLP {_percent(first.projections_on_slices)} on slices",
        ]
        canvas.box(
            lines,
            fill="#e6f4ea" if first.q_local else "#fce8e6",
            stroke=SLICED if first.q_local else "#d93025",
            title=f"{numbers} (x{len(group)}): {first.op_type} attention, {first.name}",
            cls="layer",
        )
        canvas.y += 12
    if len(groups) > MAX_FORMS:
        rest = sum(len(group) for group in groups[MAX_FORMS:])
        canvas.text(BOX_X, canvas.y + 16, f"... and {counted(rest, 'layer')} of other forms")
        canvas.y += 28
    outputs = [c for c in plan.collectives if c.role == "gather output"]
    if outputs:
        canvas.arrow(
            f"all-gather {counted(len(outputs), 'output')}: {_names([c.tensor for c in outputs])}"
        )
    canvas.y += 10
    canvas.text(
        BOX_X, canvas.y + 10, "FLOPs on slices (green) and whole (grey)", size=17, weight="bold"
    )
    canvas.y += 24
    for name in CLASSES:
        flops = plan.classes[name]
        canvas.bar(
            CLASS_TITLES[name],
            flops.share_on_slices,
            f"{_percent(flops.share_on_slices)} of {flops.total:,}",
        )
    canvas.bar(
        "all",
        plan.flops_on_slices,
        f"{_percent(plan.flops_on_slices)}; speed-up at most {plan.speedup_bound:.2f}x",
    )
    if plan.blockers:
        canvas.y += 8
        canvas.box(
            [f"{b.what}: {b.fix}" for b in plan.blockers[:4]],
            fill="#fef7e0",
            stroke="#f9ab00",
            title="What keeps work whole, and the export change that lifts it",
            cls="blockers",
        )
    height = canvas.y + 20
    body = "\n".join(canvas.parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">\n'
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>\n{body}\n</svg>'
    )


def render_html(plan: Plan) -> str:
    """The page: the SVG, and the summary as its title (self-contained, offline)."""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(summary_line(plan))}</title>\n"
        "<style>body{margin:0;background:#fff}svg{display:block}</style>\n</head>\n<body>\n"
        f"{render_svg(plan)}\n</body>\n</html>\n"
    )
