"""The offline runner's report (Markdown: answers against the expected words, memory, settings) and its
plot (cache fill, evictions and memory over the run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stream_inputs import tally


@dataclass
class RunResult:
    """What a run of the offline runner (offline.py) did; ``records`` are the JSONL log lines."""

    records: list[dict] = field(default_factory=list)
    answers: list[dict] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    bag: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    seconds: float = 0.0
    route: list[tuple[float, float, float]] = field(default_factory=list)  # the robot's poses: (bag time, x, y)
    route_frame: str = ""  # the frame they are in


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _evidence(evidence: list[dict]) -> str:
    if not evidence:
        return ""
    top = evidence[0]
    when = f"{top['stamp']:.1f} s" if top.get("stamp") is not None else "no time"
    where = f" at ({top['pose'][0]:.1f}, {top['pose'][1]:.1f}) m" if top.get("pose") else ""
    return f"{when}{where}, {top['kind']} ({top['source']})" + (f": {top['text'][:80]}" if top.get("text") else "")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_plot(result: RunResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.records if "fill" in r]
    t = [r["bag_time"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax = axes[0]
    ax.step(t, [r["fill"] for r in rows], where="post", label="cache fill")
    ax.step(t, [r["capacity"] for r in rows], where="post", linestyle="--", color="grey", label="capacity")
    ax.step(t, [r["tokens_seen"] for r in rows], where="post", alpha=0.6, label="tokens seen")
    ax.set_ylabel("tokens")
    ax.set_title("KV cache: fill against its fixed capacity")
    ax = axes[1]
    evictions = rows[-1]["evictions"] if rows else 0
    ax.step(t, [r["tokens_evicted"] for r in rows], where="post", color="tab:red",
            label=f"tokens evicted (in {evictions} evictions)")
    ax.set_ylabel("tokens")
    ax.set_title("Tokens forgotten by the eviction policy")
    ax = axes[2]
    ax.step(t, [r["kv_bytes"] / 2**20 for r in rows], where="post", label="keys and values (allocated)")
    ax.step(t, [r["cache_bytes"] / 2**20 for r in rows], where="post", label="cache with scoring state")
    ax.set_ylabel("MiB")
    twin = ax.twinx()
    twin.plot(t, [r["rss_bytes"] / 2**20 for r in rows], color="tab:green", alpha=0.7, label="process RSS")
    twin.set_ylabel("process RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("Memory: cache storage is allocated once; the process around it")
    ax.legend(loc="center left")
    twin.legend(loc="lower right")
    ax.set_xlabel("bag time (s)")
    for a in axes:
        for i, q in enumerate(result.answers):
            a.axvline(q["time_s"], color="black", alpha=0.3, linestyle=":", label="question asked" if i == 0 else None)
    axes[0].legend(loc="upper left")
    axes[1].legend(loc="upper left")
    s = result.settings
    fig.suptitle(f"{Path(result.bag.get('path', 'bag')).name}: policy {s.get('eviction_policy', '?')}, cache "
                 f"{s.get('cache_size', '?')} tokens, model {s.get('model', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_map(result: RunResult, path: str | Path) -> bool:
    """The robot's route and, numbered as in the report's answers, each answer's heaviest evidence where it has a
    pose; False (nothing written) without a route."""
    if not result.route:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6.5))
    _, xs, ys = zip(*result.route)
    ax.plot(xs, ys, color="grey", alpha=0.5, linewidth=1, label="route")
    ax.plot(xs[0], ys[0], "s", color="grey", label="start")
    shown = False
    for number, answer in enumerate(result.answers, 1):
        top = (answer.get("evidence") or [{}])[0]
        if not top.get("pose"):
            continue
        colour = {True: "tab:green", False: "tab:red"}.get(answer.get("correct"), "tab:blue")
        ax.plot(top["pose"][0], top["pose"][1], "o", color=colour, markersize=9, alpha=0.8,
                label=None if shown else "an answer's heaviest evidence (green: right, red: wrong)")
        ax.annotate(str(number), (top["pose"][0], top["pose"][1]), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
        shown = True
    ax.set_xlabel("x (m)")
    ax.set_ylabel("y (m)")
    ax.set_aspect("equal")
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{Path(result.bag.get('path', 'bag')).name}: the route and where the answers rest "
                 f"(frame {result.route_frame!r})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(result: RunResult, path: str | Path, *, with_map: bool = False) -> None:
    """The run's report in Markdown, beside the plot (`write_plot`'s plot.png)."""
    s, c = result.settings, result.counts
    rows = [r for r in result.records if "fill" in r]
    last = rows[-1] if rows else {}
    lines = [f"# Offline run: `{Path(result.bag.get('path', '')).name}`", ""]
    for notice in result.notices:
        lines += [f"> **Note:** {notice}", ""]
    lines += ["## Answers", ""]
    if result.answers:
        summary = tally([(a["correct"], a.get("needs_vision", False)) for a in result.answers])
        if summary:
            lines += [f"{summary[0].upper()}{summary[1:]}.", ""]
        lines += ["An answer that used the archive (tokens retrieved) is shown from the cache alone too. Its "
                  "heaviest evidence is the input the question pointed to most (its stream time, and a text's "
                  "words).", "",
                  "| # | Bag time (s) | Question | Expected | Answer | Right | Needs vision | Retrieved | "
                  "Without the archive | Right | Heaviest evidence |",
                  "|---:|---:|---|---|---|---|---|---:|---|---|---|"]
        marks = {True: "yes", False: "no", None: ""}
        for number, a in enumerate(result.answers, 1):
            alone = a.get("answer_without_archive")
            lines.append(f"| {number} | {a['time_s']:.1f} | {_cell(a['question'])} | {_cell(a['expected'])} | "
                         f"{_cell(a['answer'])} | {marks[a['correct']]} | {'yes' if a.get('needs_vision') else ''} | "
                         f"{a.get('retrieved_tokens', 0)} | {_cell(alone) if alone is not None else ''} | "
                         f"{marks[a.get('correct_without_archive')] if alone is not None else ''} | "
                         f"{_cell(_evidence(a.get('evidence') or []))} |")
    else:
        lines.append("No questions were asked.")
    peak_fill = max((r["fill"] for r in rows), default=0)
    lines += [
        "", "## Memory", "",
        "| Figure | Value |", "|---|---:|",
        f"| Cache capacity | {last.get('capacity', 0)} tokens |",
        f"| Fill at the end (peak between inputs) | {last.get('fill', 0)} ({peak_fill}) tokens |",
        f"| Tokens seen | {last.get('tokens_seen', 0)} |",
        f"| Tokens evicted | {last.get('tokens_evicted', 0)} in {last.get('evictions', 0)} evictions |",
        f"| Keys and values, allocated once (capacity + headroom) | {mib(last.get('kv_bytes', 0))} |",
        f"| Cache with its scoring state | {mib(last.get('cache_bytes', 0))} |",
        f"| Archive in host memory: tokens held (blocks) / storage once full | {last.get('archive_tokens', 0)} "
        f"({last.get('archive_blocks', 0)}) / {mib(last.get('archive_bytes', 0))} |",
        f"| Process RSS at the start / end / peak | {mib(rows[0]['rss_bytes']) if rows else '-'} / "
        f"{mib(last.get('rss_bytes', 0))} / {mib(last.get('peak_rss_bytes', 0))} |",
        "", "## Stream", "",
        f"Bag `{result.bag.get('path', '')}`: {result.bag.get('messages', 0)} messages over "
        f"{result.bag.get('duration_s', 0):.1f} s.", "",
        "| Topic | Type | Messages | Node input |", "|---|---|---:|---|",
    ]
    for topic, info in result.bag.get("topics", {}).items():
        lines.append(f"| `{topic}` | {info['type']} | {info['count']} | {info['input'] or '-'} |")
    frame_times = [r["seconds"] for r in result.records if r["type"] == "frame"]
    text_times = [r["seconds"] for r in result.records if r["type"] == "text"]
    answer_times = [a["seconds"] for a in result.answers]

    def mean(v):
        return f"{sum(v) / len(v):.2f} s" if v else "-"

    lines += [
        "",
        f"Frames ingested {c['frames']} (mean {mean(frame_times)}), skipped {c['frames_skipped']}, "
        f"dropped by frame_rate {c['frames_dropped']}; texts ingested {c['texts']} (mean {mean(text_times)}); "
        f"refused {c['rejected']}; answers {c['answers']} (mean {mean(answer_times)}); poses {c.get('poses', 0)}"
        f" (refused {c.get('poses_refused', 0)}). "
        f"Whole run {result.seconds:.1f} s.",
        "", "## Settings", "", "| Setting | Value |", "|---|---|",
    ]
    for key, value in s.items():
        lines.append(f"| {key} | {_cell(value if value is not None else '(default)')} |")
    for key, value in result.model.items():
        lines.append(f"| model {key} | {_cell(value)} |")
    lines += ["", "## Cache fill, evictions and memory over the run", "", "![cache over the run](plot.png)"]
    if with_map:
        lines += ["", "## Where the answers rest", "", "The robot's route and each answer's heaviest evidence, "
                  "numbered as in the answers above.", "", "![route and evidence](map.png)"]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
