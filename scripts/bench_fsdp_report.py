"""Results of `scripts.bench_fsdp`: per-rank records combined into one row per config, and
the markdown table it prints. Split out of bench_fsdp.py to keep each file to one concept
(running the configs there, reporting them here)."""

from __future__ import annotations

import statistics

from scripts.bench_common import fmt, markdown_table

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def combine(per_rank: list[dict], tokens_per_step: int) -> dict:
    """Rank 0's counts; the slowest rank's time; the largest rank's memory; any error."""
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r["error"]]
    if errors:
        return {"config": per_rank[0]["config"], "error": errors[0], "errors": errors}
    out = dict(per_rank[0])
    out["step_ms_median"] = max(r["step_ms_median"] for r in per_rank)
    out["tokens_per_s"] = tokens_per_step / (out["step_ms_median"] * 1e-3)
    mems = [r["peak_mem_mib"] for r in per_rank if r["peak_mem_mib"] is not None]
    out["peak_mem_mib"] = max(mems) if mems else None
    ag_bytes = out["per_step"]["all_gather_bytes"]
    if ag_bytes and out["converted_elems"]:  # (FSDP2 may skip all-gathers on one rank)
        out["converted_ag_bytes"] = ag_bytes - out["other_bytes"]
        per_elem = out["converted_ag_bytes"] / out["converted_elems"]
        out["converted_ag_bytes_per_elem"] = per_elem
        out["converted_ag_ratio_vs_bf16_bytes"] = per_elem / 2
    out["final_loss"] = statistics.fmean(r["losses"][-1] for r in per_rank)
    return out


def _kinds(counts: dict) -> str:
    return "/".join(str(counts[f"{k}_count"]) for k in KINDS)


def table(results: list[dict]) -> str:
    headers = ["config", "step ms", "AG MiB/step", "conv AG ratio", "RS MiB/step"]
    headers += ["AG/RS/AR per step", "scale ARs: init/first/step", "peak MiB", "host reads"]
    headers += ["final loss", "error"]
    rows = []
    for r in results:
        if "per_step" not in r:
            rows.append([r["config"]] + ["-"] * (len(headers) - 2) + [r["error"] or ""])
            continue
        s = r["per_step"]
        scale_ars = [r[k]["scale_all_reduces"] for k in ("init", "first_step", "per_step")]
        rows.append(
            [
                r["config"],
                fmt(r["step_ms_median"], ".1f"),
                fmt(s["all_gather_bytes"] / 2**20, ".3f"),
                fmt(r.get("converted_ag_ratio_vs_bf16_bytes"), ".3f"),
                fmt(s["reduce_scatter_bytes"] / 2**20, ".3f"),
                _kinds(s),
                "/".join(str(n) for n in scale_ars),
                fmt(r["peak_mem_mib"], ".1f"),
                str(r["host_reads_per_step"]),
                fmt(r["final_loss"], ".4f"),
                r["error"] or "",
            ]
        )
    return markdown_table(headers, rows)
