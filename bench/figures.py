"""Render the benchmark figures of README.md and docs/benchmarks.md from the benchmarks' JSON.

Every figure the README's "Performance at a glance" and the result tables of
docs/benchmarks.md give comes from a file in ``docs/bench/`` that a benchmark wrote, through
a renderer here; the text sits between two markers::

    <!-- figures: trl-table -->
    ...rendered text...
    <!-- /figures -->

Commands::

    python -m bench.figures                 # rewrite every marked block from docs/bench/*.json
    python -m bench.figures --check         # exit 1 naming each block its JSON disagrees with
    python -m bench.figures --update trl    # copy bench/results/trl.json to docs/bench/, render

A benchmark re-run thus updates the JSON and the text together (``--update NAME`` after the
run), and CI (``tests/bench/test_figures.py``) fails when someone edits a figure by hand or a
JSON without the text.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("docs/bench")
PAGES = (
    Path("README.md"),
    Path("docs/benchmarks.md"),
    Path("docs/transferqueue/reliability.md"),
    Path("docs/transferqueue/performance.md"),
)
BLOCK = re.compile(r"(<!-- figures: ([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)

Json = dict[str, Any]
Renderer = Callable[[Callable[[str], Json]], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        if name in RENDERERS:
            raise ValueError(f"figures renderer {name!r} is registered twice")
        RENDERERS[name] = fn
        return fn

    return register


def x(ratio: float) -> str:
    """A ratio as the docs write it: 3 significant figures, ``x`` after."""
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"


def num(value: float, digits: int = 3) -> str:
    """A figure with ``digits`` significant figures, thousands separated."""
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def day(data: Json) -> str:
    return str(data["time"])[:10]


# --- README: performance at a glance ------------------------------------------------------


@renderer("readme-throughput")
def _readme_throughput(load: Callable[[str], Json]) -> str:
    d = load("throughput")
    r = d["ratios"]
    return (
        "- TransferQueue service (`python -m bench.throughput`, run of "
        f"{day(d)}), put + get of a 302 MB dense batch through shared memory: "
        f"{x(r['1 unit: dense vs ray'])} Ray with 1 unit, {x(r['4 units: dense vs ray'])} "
        "with 4; 256 ragged sequences, one tensor each: "
        f"{x(r['1 unit: ragged-seqs vs ray'])} Ray.\n"
    )


@renderer("readme-peer")
def _readme_peer(load: Callable[[str], Json]) -> str:
    d = load("peer")
    r = d["ratios"]
    return (
        f"- Against TransferQueue 0.1.11 (`python -m bench.peer`, run of {day(d)}): "
        f"{x(r['dense 1u'])} on the dense batch and {x(r['ragged 1u'])} on ragged sequences "
        f"with one unit ({x(r['dense 4u'])} / {x(r['ragged 4u'])} with four); a `get_meta` "
        f"of 64 rows from a partition of 1M rows {x(r['meta 1000000 1u'])}, from one of 1k "
        f"rows {x(r['meta 1000 1u'])} ({x(d['ratios_with_ack']['meta 1000 1u'])} with the "
        "ack; the goal is 5x)" + _wire(d) + _facade(d) + ".\n"
    )


def _wire(d: Json) -> str:
    """Our get_meta at 1k rows against the same run's bare ZeroMQ round trip, if measured."""
    w = d.get("wire", {}).get("1u")
    if w is None:
        return ""
    return (
        f"; that call takes {w['ours_us']:.0f} us, {x(w['ratio'])} a bare ZeroMQ round trip "
        f"of the same shape in the same run ({w['bare_us']:.0f} us; the goal is 2x)"
    )


@renderer("readme-peer-multimodal")
def _readme_peer_multimodal(load: Callable[[str], Json]) -> str:
    d = load("peer-multimodal")
    r, f = d["ratios"], d["ratios_facade"]
    return (
        f"- A vision-language batch against the same peer (`{d['command']}`, run of "
        f"{day(d)}: 64 images `[3, H, W]` uint8, H and W per row in 224-1024, with token ids "
        f"and scalars): {x(r['multimodal 1u'])} natively with one unit, "
        f"{x(r['multimodal 4u'])} with four (the goal is 5x); the facade "
        f"{x(f['multimodal 1u'])} / {x(f['multimodal 4u'])} (goal 3x).\n"
    )


def _facade(d: Json) -> str:
    """The peer's own calls on our store through the facade, where the run measured it."""
    f = d.get("ratios_facade")
    if not f:
        return ""
    return (
        "; the peer's own calls on our store through the `transfer_queue` facade, same run: "
        f"{x(f['dense 1u'])} / {x(f['dense 4u'])} the peer on the dense batch (1 / 4 units), "
        f"{x(f['meta 1000 1u'])} / {x(f['meta 1000 4u'])} on that `get_meta`"
    )


def _staleness_keys(data: Json) -> list[str]:
    return sorted(k for k in data["ratios"] if k.startswith("k="))


@renderer("readme-trl")
def _readme_trl(load: Callable[[str], Json]) -> str:
    d = load("trl")
    m, r = d["means"], d["ratios"]
    s = d["settings"]
    keys = _staleness_keys(d)
    speed = ", ".join(f"**{x(r[k]['samples_per_s'])}** with `max_staleness={k[2:]}`" for k in keys)
    ours = " / ".join(num(m[k]["samples_per_s"]) for k in keys)
    firsts = " / ".join(f"{m[k]['first_step_s']:.1f}" for k in _staleness_keys(d))
    return (
        "- Against TRL's `GRPOTrainer` (`python -m bench.trl`, run of "
        f"{day(d)}: TRL {d['versions'].get('trl', '1.16.0')}, the demo's model, prompts, "
        f"reward and hyperparameters, TRL in float32 without gradient checkpointing as ours, "
        f"{s['steps']} steps, means over {s['seeds']} seeds): {speed} its samples/s "
        f"({ours} vs {num(m['trl']['samples_per_s'])}); the first step after "
        f"{firsts} s against TRL's {m['trl']['first_step_s']:.1f} s; final rewards "
        + (
            "within TRL's spread"
            if all(r[k]["reward_within_spread"] for k in _staleness_keys(d)[:2])
            else "outside TRL's spread for some settings (see the table)"
        )
        + ".\n"
    )


@renderer("readme-trl-smollm2")
def _readme_trl_smollm2(load: Callable[[str], Json]) -> str:
    d = load("trl-smollm2")
    m, r = d["means"], d["ratios"]
    s = d["settings"]
    return (
        f"- SmolLM2-135M against TRL (`python -m bench.trl --case smollm2 --steps {s['steps']} "
        f"--seeds {s['seeds']} --staleness 0`, run of {day(d)}, HF generation on both sides): "
        f"**{x(r['k=0']['samples_per_s'])}** its samples/s with `max_staleness=0` "
        f"({m['k=0']['samples_per_s']:.2f} vs {m['trl']['samples_per_s']:.2f}), the first "
        f"step after {m['k=0']['first_step_s']:.1f} vs {m['trl']['first_step_s']:.1f} s.\n"
    )


@renderer("readme-ray-overhead")
def _readme_ray_overhead(load: Callable[[str], Json]) -> str:
    d, c = load("ray_overhead"), load("ray_overhead_colocate")
    st, fs, g = d["step_ms"], d["first_step_s"], d["goals"]
    return (
        "- `deploy=ray` against `deploy=local` (`python -m bench.ray_overhead`, run of "
        f"{day(d)}, the tiny demo synchronous): **{st['overhead']:.1f} ms** more per step "
        f"({st['ray']:.1f} vs {st['local']:.1f} ms; goal {g['overhead_ms']:.0f}), first step "
        f"after {fs['ray']:.1f} s ({fs['local']:.1f} s local; goal {g['first_step_s']:.0f}); "
        f"{c['step_ms']['overhead']:.1f} ms with `--set reward.colocate=true`.\n"
    )


def _vs(data: Json, schedule: str, baseline: str) -> float:
    s = data["schedules"]
    return float(s[schedule]["samples_per_s"] / s[baseline]["samples_per_s"])


@renderer("readme-rl")
def _readme_rl(load: Callable[[str], Json]) -> str:
    rl, ag, pa = load("rl"), load("rl_agentic"), load("rl_partial")
    g = rl["setup"]["gpus"]
    kept = pa["schedules"]["async-k2-partial"]["kept_share"]
    return (
        f"- RL schedules on {g} simulated GPUs with a long-tailed workload (`python -m "
        f"bench.rl`, run of {day(rl)}): asynchronous training with `k = 2` runs "
        f"{x(_vs(rl, 'async-k2', 'colocated-sync'))} colocated synchronous training; on "
        f"multi-turn episodes with a long-tailed environment (`--workload agentic`) "
        f"{x(_vs(ag, 'async-k2', 'colocated-sync'))}. Partial rollouts (`async-k2-partial`) "
        f"run {x(_vs(pa, 'async-k2-partial', 'async-k2'))} `async-k2` and keep "
        f"{kept:.0%} of each step's tokens across weight updates.\n"
    )


# --- docs/benchmarks.md: result tables ----------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    rule = (
        "|"
        + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, rule, *body]) + "\n"


@renderer("throughput-table")
def _throughput_table(load: Callable[[str], Json]) -> str:
    d = load("throughput")
    gb, r = d["GBps"], d["ratios"]
    names = {
        "dense": "dense f32 1024 x 8192 x 9 (302 MB)",
        "ragged": "256 ragged seqs, 128-4096 ids + logprobs, packed (4.5 MB)",
        "ragged-seqs": "the same, one tensor per sequence (4.1 MB)",
    }
    rows = []
    for case, name in names.items():
        one, four = gb["transferqueue 1 unit"][case], gb["transferqueue 4 units"][case]
        f1, f4 = gb["transferqueue 1 unit frames"][case], gb["transferqueue 4 units frames"][case]
        rows.append(
            [
                name,
                f"{gb['raw zmq'][case]:.2f} GB/s",
                f"{one:.2f} / {four:.2f}",
                f"{f1:.2f} / {f4:.2f}",
                f"{gb['ray object store'][case]:.2g}",
                f"{x(r[f'1 unit: {case} vs ray'])} / {x(r[f'4 units: {case} vs ray'])}",
                f"{x(r[f'1 unit frames: {case} vs ray'])} / "
                f"{x(r[f'4 units frames: {case} vs ray'])}",
            ]
        )
    head = ["payload", "raw ZeroMQ", "TQ 1 / 4 units", "TQ frames 1 / 4 units", "Ray"]
    head += ["TQ / Ray (1 / 4 units)", "TQ frames / Ray"]
    wire = d["wire_get_meta_ack_samples_per_s"]
    return (
        f"Run of {day(d)} (`docs/bench/throughput.json`):\n\n"
        + _table(head, rows)
        + f"\nController get_meta + ack over the wire: {num(wire)} samples/s at batch 64.\n"
    )


@renderer("peer-table")
def _peer_table(load: Callable[[str], Json]) -> str:
    d = load("peer")
    gb, meta, r, ra = d["GBps"], d["meta_samples_per_s"], d["ratios"], d["ratios_with_ack"]
    rows = []
    for case, name in (
        ("dense", "dense f32 1024 x 8192 x 9 (302 MB)"),
        ("ragged", "256 ragged seqs, ids + logprobs (4.5 MB)"),
    ):
        row = [name]
        for u in ("1u", "4u"):
            c = gb[f"{case} {u}"]
            row += [f"{c['ours']['median']:.2f} GB/s", f"{c['peer']['median']:.3g}"]
            row.append(f"**{x(r[f'{case} {u}'])}**")
        rows.append(row)
    for live in d["settings"]["meta_live"]:
        label = f"{live // 1000}k" if live < 1_000_000 else f"{live // 1_000_000}M"
        row = [f"get_meta of {d['settings']['meta_batch']}, {label} rows (with ack)"]
        for u in ("1u", "4u"):
            c = meta[f"{live} {u}"]
            row += [f"{num(c['ours'])} ({num(c['ours_with_ack'])})/s", num(c["peer"])]
            row.append(f"{x(r[f'meta {live} {u}'])} ({x(ra[f'meta {live} {u}'])})")
        rows.append(row)
    if d.get("wire"):  # our get_meta at the fewest rows / the bare round trip (bench/bare.py)
        row = ["bare ZeroMQ round trip; ours get_meta, 1k rows / it"]
        for u in ("1u", "4u"):
            w = d["wire"][u]
            row += [f"{w['ours_us']:.0f} us", f"bare {w['bare_us']:.0f} us", x(w["ratio"])]
        rows.append(row)
    head = ["case", "ours 1 unit", "peer 1 unit", "ours / peer", "ours 4 units"]
    head += ["peer 4 units", "ours / peer"]
    return f"Run of {day(d)} (`docs/bench/peer.json`), medians:\n\n" + _table(head, rows)


@renderer("peer-multimodal-table")
def _peer_multimodal_table(load: Callable[[str], Json]) -> str:
    d = load("peer-multimodal")
    gb, r, rf = d["GBps"], d["ratios"], d["ratios_facade"]
    units = sorted({k.split()[1] for k in gb}, key=lambda u: int(u[:-1]))
    nbytes = next(iter(d["raw"].values()))["describe"]["ours"]["nbytes"]["multimodal"]

    def cell(c: Json) -> str:
        return f"{c['median']:.2f} GB/s ({c['put_ms']:.0f} / {c['get_data_ms']:.0f} ms)"

    rows = []
    for u in units:
        c = gb[f"multimodal {u}"]
        rows.append(
            [
                u.replace("u", ""),
                cell(c["ours"]),
                cell(c["peer"]),
                cell(c["facade"]),
                f"**{x(r[f'multimodal {u}'])}**",
                f"**{x(rf[f'multimodal {u}'])}**",
            ]
        )
    head = ["units", "ours (put / get_data)", "peer", "facade", "ours / peer", "facade / peer"]
    return (
        f"Run of {day(d)} (`docs/bench/peer-multimodal.json`, `{d['command']}`; "
        f"{nbytes / 1e6:.1f} MB a batch), medians:\n\n" + _table(head, rows)
    )


@renderer("chaos-table")
def _chaos_table(load: Callable[[str], Json]) -> str:
    d = load("chaos")

    def s(v: float | None, sign: bool = False) -> str:
        return "-" if v is None else (f"{v:+.1f} s" if sign else f"{v:.1f} s")

    rows = [
        [
            str(i + 1),
            f["kind"],
            f["target"],
            str(f["steps_at_start"]),
            s(f["named_after_s"]),
            s(f["worst_step_s"]),
            s(f["cost_s"], sign=True),
            "; ".join(f["notes"]) or "",
        ]
        for i, f in enumerate(d["faults"])
    ]
    head = ["#", "fault", "target", "at step", "named after", "worst step", "over median", ""]
    held = "held" if not d["failed"] else "FAILED: " + "; ".join(d["failed"])
    restarts = ", ".join(f"{k} {v}" for k, v in sorted(d["restarts"].items())) or "none"
    return (
        f"Run of {day(d)} (`docs/bench/chaos.json`, "
        f"`{' '.join(['python -m bench.chaos', *d['argv']])}`): {d['steps']} steps in "
        f"{d['wall_s']:.0f} s, median step "
        f"{d['median_step_s']:.2f} s, freezes and slowdowns of {d['freeze_s']:g} s; restarts: "
        f"{restarts}; invariants (every group trained once, each step its own window, whole, "
        f"within the staleness bound): {held}.\n\n" + _table(head, rows)
    )


@renderer("rl-elastic-table")
def _rl_elastic_table(load: Callable[[str], Json]) -> str:
    d = load("rl_elastic")
    fixed = d["fixed_samples_per_s"]
    rows = [
        [
            str(p["instances"]),
            f"{p['first_step']}-{p['last_step']}",
            num(p["samples_per_s"]),
            num(fixed[str(p["instances"])]),
            x(p["over_fixed"]),
        ]
        for p in d["phases"]
        if p["steady_steps"] and str(p["instances"]) in fixed  # (not a count passed through)
    ]
    took = "; ".join(
        f"`rollout={c['n']}` after step {c['asked_at_step']}, done in {c['took_s']:.1f} s"
        for c in d["scale_commands"]
    )
    held = "held" if d["exactly_once"] and d["staleness_bound"] else "FAILED"
    head = ["generators", "steps", "elastic run, samples/s", "fixed run, samples/s", "ratio"]
    return (
        f"Run of {day(d)} (`docs/bench/rl_elastic.json`, `{d['command']}`; "
        f"{d['setup']['steps']} steps of {d['setup']['groups_per_step']} groups, samples/s "
        f"in modelled time): {took}. Every group trained exactly once and the staleness bound "
        f"in every run: {held}.\n\n" + _table(head, rows)
    )


@renderer("trl-table")
def _trl_table(load: Callable[[str], Json]) -> str:
    d = load("trl")
    m, r = d["means"], d["ratios"]
    label = {"trl": "TRL, matched (fp32, no checkpointing)"}

    def name(k: str) -> str:
        return label.get(k, f"ours, `max_staleness={k[2:]}`")

    def thr(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} s"

    th = d["settings"]["threshold"]
    rows = [
        [
            name(k),
            num(m[k]["samples_per_s"]),
            f"{m[k]['first_step_s']:.1f} s",
            f"{m[k]['reward_first']:.3f} -> {m[k]['reward_last']:.3f}",
            thr(m[k]["threshold_s"]),
        ]
        for k in ["trl", *_staleness_keys(d)]
    ]
    head = ["system", "samples/s", "first step", "reward first -> last 10%", f"to reward {th}"]
    ratio_rows = [
        [
            f"`max_staleness={k[2:]}`",
            f"**{x(r[k]['samples_per_s'])}**",
            f"{r[k]['first_step']:.2f}",
            "yes" if r[k]["reward_within_spread"] else "no",
        ]
        for k in _staleness_keys(d)
    ]
    goals = ", ".join(f"{g}: {'met' if ok else 'NOT met'}" for g, ok in d["goals"].items())
    return (
        f"Run of {day(d)} (`docs/bench/trl.json`, {d['settings']['steps']} steps, means over "
        f"{d['settings']['seeds']} seeds):\n\n"
        + _table(head, rows)
        + "\n"
        + _table(
            ["ours / TRL matched", "samples/s", "first step", "final reward in TRL's spread"],
            ratio_rows,
        )
        + f"\nGoals as the bench printed them: {goals}.\n"
    )


@renderer("trl-smollm2-table")
def _trl_smollm2_table(load: Callable[[str], Json]) -> str:
    d = load("trl-smollm2")
    m, pr = d["means"], d["per_run"]
    rows = []
    for k, name in (("trl", "TRL, matched"), ("k=0", "ours, `max_staleness=0`")):
        per_seed = " / ".join(f"{run['samples_per_s']:.2f}" for run in pr[k])
        rows.append(
            [
                name,
                per_seed,
                f"{m[k]['first_step_s']:.1f} s",
                f"{m[k]['reward_first']:.2f} -> {m[k]['reward_last']:.2f}",
            ]
        )
    head = ["system", "samples/s (per seed)", "first step (mean)", "reward first -> last 10%"]
    return (
        f"Run of {day(d)} (`docs/bench/trl-smollm2.json`), ours / TRL "
        f"**{x(d['ratios']['k=0']['samples_per_s'])}** samples/s:\n\n" + _table(head, rows)
    )


@renderer("ray-overhead-table")
def _ray_overhead_table(load: Callable[[str], Json]) -> str:
    d, c = load("ray_overhead"), load("ray_overhead_colocate")
    g = d["goals"]
    rows = []
    for data, what in ((d, "default"), (c, "`reward.colocate=true`")):
        st, fs = data["step_ms"], data["first_step_s"]
        rows.append(
            [
                f"synchronous step, {what}",
                f"{st['local']:.1f} ms",
                f"{st['ray']:.1f} ms",
                f"**{st['overhead']:.1f} ms**",
                f"<= {g['overhead_ms']:.0f} ms over local",
            ]
        )
        rows.append(
            [
                f"time to first step, {what}",
                f"{fs['local']:.1f} s",
                f"{fs['ray']:.1f} s",
                "",
                f"ray <= {g['first_step_s']:.0f} s",
            ]
        )
    head = ["figure", "deploy=local", "deploy=ray", "ray - local", "goal"]
    return (
        f"Runs of {day(d)} (`docs/bench/ray_overhead.json`, "
        "`docs/bench/ray_overhead_colocate.json`):\n\n" + _table(head, rows)
    )


@renderer("rl-table")
def _rl_table(load: Callable[[str], Json]) -> str:
    d = load("rl")
    s = d["schedules"]
    base = s["colocated-sync"]["samples_per_s"]
    rows = []
    for name, v in s.items():
        splits = v.get("splits_tried", {})
        shared = v["gen_gpus"] == d["setup"]["gpus"]
        rows.append(
            [
                name,
                f"{v['samples_per_s']:.2f}",
                f"{v['samples_per_s'] / base:.2f}x",
                f"{v['gen_gpus']} (shared)" if shared else str(v["gen_gpus"]),
                "-" if shared else " / ".join(f"{splits[k]:.2f}" for k in sorted(splits, key=int)),
                f"{v['gen_busy']:.2f}",
                f"{v['pipeline_bubble']:.2f}",
                f"{v['skew_bubble']:.2f}",
                f"{v['stage_idle']['train']:.2f}",
            ]
        )
    head = ["schedule", "samples/s", "vs colocated-sync", "best split (gen)"]
    head += ["samples/s per split tried", "gen busy", "pipeline bubble", "skew bubble"]
    head.append("train idle")
    return f"Run of {day(d)} (`docs/bench/rl.json`):\n\n" + _table(head, rows)


# --- rendering and checking ---------------------------------------------------------------


from bench.figures_load import load_table, readme_load  # noqa: E402

RENDERERS["readme-load"] = readme_load
RENDERERS["load-table"] = load_table


def _loader(root: Path) -> Callable[[str], Json]:
    cache: dict[str, Json] = {}

    def load(name: str) -> Json:
        if name not in cache:
            cache[name] = json.loads((root / DATA / f"{name}.json").read_text())
        return cache[name]

    return load


def render(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """Each page's (current text, text with every marked block rendered from the JSON)."""
    load = _loader(root)
    out: dict[Path, tuple[str, str]] = {}
    for page in PAGES:
        text = (root / page).read_text()

        def fill(match: re.Match[str], page: Path = page) -> str:
            name = match.group(2)
            if name not in RENDERERS:
                known = ", ".join(sorted(RENDERERS))
                raise ValueError(f"{page}: unknown figures block {name!r}; known: {known}")
            return match.group(1) + RENDERERS[name](load) + match.group(4)

        out[page] = (text, BLOCK.sub(fill, text))
    return out


def stale_blocks(root: Path = ROOT) -> list[str]:
    """The blocks whose text differs from what their JSON renders, as ``page: name``."""
    load = _loader(root)
    stale = []
    for page in PAGES:
        for match in BLOCK.finditer((root / page).read_text()):
            render_block = RENDERERS.get(match.group(2))
            if render_block is None or render_block(load) != match.group(3):
                stale.append(f"{page}: {match.group(2)}")
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--check", action="store_true", help="fail when a block disagrees with its JSON"
    )
    ap.add_argument(
        "--update",
        nargs="+",
        metavar="NAME",
        default=[],
        help="copy bench/results/NAME.json into docs/bench/ first",
    )
    args = ap.parse_args(argv)
    for name in args.update:
        src = ROOT / "bench" / "results" / f"{name}.json"
        if not src.exists():
            ap.error(f"--update {name}: {src.relative_to(ROOT)} does not exist; run the benchmark")
        shutil.copy2(src, ROOT / DATA / f"{name}.json")
        print(f"copied {src.relative_to(ROOT)} -> {DATA / f'{name}.json'}")
    if args.check:
        stale = stale_blocks()
        for block in stale:
            print(f"{block}: the text differs from its JSON; run `python -m bench.figures`")
        print(f"figures: {len(stale)} stale block(s)" if stale else "figures: every block matches")
        return 1 if stale else 0
    for page, (old, new) in render().items():
        if old != new:
            (ROOT / page).write_text(new)
            print(f"rendered {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
