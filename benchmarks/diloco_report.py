"""How ``diloco_quality.py`` prints one run: the outer steps beside the references, then the
summary lines (losses, gap closed, rounds, starts, the slowed node, time to one node's final
loss and the waits that ended by timeout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_quality import Result


def fmt(value: float | None, width: int = 7) -> str:
    return f"{value:{width}.3f}" if isinstance(value, float) else f"{'-':>{width}}"


def report(result: Result) -> None:
    s = result.settings
    print(
        f"\nDiLoCo {s['nodes']} nodes, H {s['inner_steps']}, {s['steps']} steps x batch "
        f"{s['batch']} per node, node data {s['node_data']}, overrides {s['overrides'] or '-'}"
    )
    print(" outer  node step  nodes  staleness   global  one node  N x batch  reason")
    for row in result.outer:
        stale = ",".join(map(str, row["staleness"])) or "-"
        step = row["node_step"] if row["node_step"] is not None else "-"
        print(
            f"{row['outer_step']:6d}  {step!s:>9}  {row['nodes']:5d}  {stale:>9}  "
            f"{fmt(row['global_loss'])}  {fmt(row['one_node'], 8)}  {fmt(row['n_x_batch'], 9)}"
            f"  {row['reason']}"
        )
    m = result.summary
    own = ", ".join(f"{k} {fmt(v, 0)}" for k, v in m["nodes_own"].items())
    print(
        f"\nfinal global {fmt(m['final_global'], 0)} | one node {fmt(m['one_node'], 0)} | "
        f"{s['nodes']} x batch {fmt(m['n_x_batch'], 0)} | nodes' own: {own}"
    )
    print(
        f"best global {fmt(m['best_global'], 0)} (outer step {m['best_global_outer_step']}); "
        f"global / one node {fmt(m['global_over_one_node'], 0)}, global / N x batch "
        f"{fmt(m['global_over_n_x_batch'], 0)}, gap closed {fmt(m['gap_closed'], 0)}"
    )
    print(
        f"outer steps {m['outer_steps']}, with fewer than {s['nodes']} nodes "
        f"{m['short_rounds']} (by nodes: {m['rounds_by_nodes']}); staleness mean "
        f"{fmt(m['staleness_mean'], 0)} max {m['staleness_max']} (histogram "
        f"{m['staleness_hist']})"
    )
    print(
        f"second half's worst global {fmt(m['second_half_worst'], 0)} vs first half's best "
        f"{fmt(m['first_half_best'], 0)}: {fmt(m['second_half_above_best'], 0)} above"
    )
    print(f"rounds closed by: {m['round_reasons']}")
    starts = ", ".join(
        f"{name} +{start['after_master_s']:g} s"
        + (
            f" (global {start['global_outer_step']})"
            if start["global_outer_step"] is not None
            else ""
        )
        for name, start in m["starts"].items()
    )
    print(f"starts after the master's: {starts}")
    if m.get("arrived_after_the_end"):
        print(
            f"started after the master's end (stopped at once, exit 3): "
            f"{', '.join(m['arrived_after_the_end'])}"
        )
    slow = m.get("slow_node")
    if slow:
        median = slow.get("median_step_s")
        print(
            f"slow node {slow['node']}: {s['slow_node']:g}x ({slow['mechanism']}; its median "
            f"step {fmt(median, 0)} s, slept {slow.get('slept_s', '-')} s)"
        )
    reached = m["time_to_one_node_s"]
    print(
        f"time to one node's final loss {fmt(m['one_node'], 0)}: "
        + (f"{reached} s after the master's start" if reached is not None else "never reached")
        + f"; one node's wall {m['one_node_wall_s']} s; ratio "
        f"{fmt(m['time_to_one_node_ratio'], 0)}"
    )
    if m.get("steps_to_one_node") is not None:
        print(
            f"  in node steps: the global of node step {m['steps_to_one_node']} reached it; "
            f"ratio {fmt(m['steps_to_one_node_ratio'], 0)} (the wall ratio with a machine per node)"
        )
    waits = ", ".join(
        f"{name} {fmt(w['timeout_share'], 0)} (gave up {w['timeouts']} x, {w['timeout_s']:.1f} s; "
        f"rounds the master closed by timeout {w['round_timeouts']} x, "
        f"{w['round_timeout_s']:.1f} s; all waits {w['waits'] + w['timeouts']} x, "
        f"{w['waited_s'] + w['timeout_s']:.1f} s)"
        for name, w in m["waits"].items()
    )
    print(
        f"wall share in boundary waits that ended by a timeout (max "
        f"{fmt(m['timeout_wait_share'], 0)}): {waits}"
    )
    print(
        f"wall: DiLoCo {m['diloco_wall_s']} s, references {m['references_wall_s']} s; load "
        f"average {m['load_average']}"
    )
