"""bench/rollout.py's report: the tables it prints once every engine has run (throughput against the peers and
the ceilings, streaming latency, the bus cost per step, workloads M and L, A on CPU time) and its plot. Reads
the results dict bench/rollout.py builds (and saves with --json), never an engine."""

from __future__ import annotations

import sys

from bench.rollout_workloads import AGENTIC, LONG, WIDE


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(results: dict, args, peak: float, emulation: str | None) -> None:
    """Print every table for `results` (per dtype), run with `args` (bench/rollout.py's), on a host whose fp32
    FMA peak is `peak` FLOP/s; `emulation`: the line saying which no-native-bf16 emulation ran, if any."""
    def cell(x: float | None, fmt: str = "{:.0f}") -> str:
        return fmt.format(x) if x else "-"

    peers = [c for c in args.vllm_configs if args.vllm]
    rows = [["dtype", "workload", "rollbus tok/s", *(f"vLLM {c} tok/s" for c in peers), "HF tok/s",
             *(f"vs vLLM {c}" for c in peers), "vs HF", "GEMM ceiling", "of ceiling", "of FMA peak"]]
    for dtype, r in results.items():
        work = [("A", f"{args.num_prompts}x{args.max_tokens} fixed")] + [("B", "16 x n=8")] * ("B" in r)
        work += [("W", f"{WIDE[0]} x n={WIDE[1]} x {WIDE[2]} fixed")] if "W" in r else []
        work += [("M", f"agentic {AGENTIC[0]} x {AGENTIC[1]} turns")] if "M" in r else []
        for w, name in work:
            for lay in (r, *r["layouts"].values()):
                ours = lay[w]["tok_s"]
                vl = [r["vllm_all"][c].get(w, {}).get("tok_s") for c in peers]
                hf = r.get(f"hf_{w}", {}).get("tok_s")
                ceil = r.get(f"ceiling_{w}")
                fma = r.get(f"fma_ceiling_{w}")
                label = name + (f", rollbus -dp {lay['dp']}" if len(args.rollbus_dp) > 1 or lay["dp"] > 1 else "")
                label += f", KV {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
                label += ", async scheduling" if args.async_scheduling else ""
                label += ", no in-batch sharing" if args.no_in_batch_prefix_sharing else ""
                beside = args.prefill_tokens_beside_decodes
                label += "" if beside is None else f", prefill beside decodes {beside or 'unlimited'}"
                rows.append([dtype, label, cell(ours), *map(cell, vl), cell(hf),
                             *(cell(v and ours / v, "{:.2f}x") for v in vl),
                             cell(hf and ours / hf, "{:.2f}x"), cell(ceil), cell(ceil and ours / ceil, "{:.0%}"),
                             cell(fma and ours / fma, "{:.0%}")])
    print(f"\nModel: {args.shape_name}" + (" (--load-format dummy)" if args.shape_name != "smollm2" else ""))
    if emulation:
        print(f"\n{emulation}")
    print("rollbus /server_info cpu_linear: " + ", ".join(f"{d} {' / '.join(r['cpu_linear'])}"
                                                          for d, r in results.items()))
    print("\nThroughput (useful tokens/s; the GEMM ceiling is the workload's FLOPs at the large-GEMM rate "
          "measured in this run, before and after rollbus's workloads, the higher of the two: "
          + ", ".join(f"{d} {r['gemm_gflops']:.0f} GFLOP/s ({'{:.0f} / {:.0f}'.format(*r['gemm_gflops_before_after'])})"
                      for d, r in results.items())
          + f"; the FMA peak, the fp32 limit of any GEMM here: {peak / 1e9:.0f} GFLOP/s, bench/fma_peak.py)\n"
          + table(rows))
    if args.repeats > 1:
        print("\nrollbus's runs (tok/s, in the order run; the table gives the median):")
        for dtype, r in results.items():
            for lay in (r, *r["layouts"].values()):
                for w in ("A", "W"):
                    if w in lay:
                        print(f"  {dtype} -dp {lay['dp']} {w}: " + ", ".join(f"{x:.0f}" for x in lay[w]["runs"]))
    rows = [["dtype", "streams", "TTFT p50 ms", "TTFT max ms", "ITL p50 ms", "ITL p99 ms"]]
    for dtype, r in results.items():
        for lay in (r, *r["layouts"].values()):
            for s in () if "C" in args.skip else (1, 32):
                c = lay[f"C{s}"]
                who = dtype + (f" -dp {lay['dp']}" if len(args.rollbus_dp) > 1 or lay["dp"] > 1 else "")
                rows.append([who, str(s), f"{c['ttft_ms_p50']:.1f}", f"{c['ttft_ms_max']:.1f}",
                             f"{c['itl_ms_p50']:.1f}", f"{c['itl_ms_p99']:.1f}"])
        for conf in () if "C" in args.skip else peers:
            c = r["vllm_all"][conf]["C32"]
            rows.append([f"{dtype} vLLM {conf}", "32", f"{c['ttft_ms_p50']:.1f}", f"{c['ttft_ms_max']:.1f}",
                         f"{c['itl_ms_p50']:.1f}", f"{c['itl_ms_p99']:.1f}"])
    if len(rows) > 1:  # not with --skip C
        print("\nStreaming latency over HTTP\n" + table(rows))
    rows = [["dtype", "workload", "steps", "step ms (scheduler)", "compute ms (worker)", "bus hop ms/step",
             "between steps ms"]]
    for dtype, r in results.items():
        for w, key in (("A", "bus"), ("W", "bus_W")):
            if key in r:
                b = r[key]
                rows.append([dtype, w, f"{b['steps']:.0f}", f"{b['step_ms']:.2f}", f"{b['compute_ms']:.2f}",
                             f"{b['hop_ms']:.3f}", f"{b['between_ms']:.2f}"])
    print("\nBus cost per step (workloads A and W; counters summed over engines)\n" + table(rows))
    engines = {"rollbus": lambda r: r, **{f"vLLM {c}": (lambda r, c=c: r["vllm_all"][c]) for c in peers}}
    if args.agentic:
        rows = [["dtype", "engine", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "cache hit tokens", "of ideal"]]
        for dtype, r in results.items():
            for who, get in engines.items():
                m = get(r)["M"]
                hits = f"{m['cache_hit_tokens']:.0f} / {m['ideal_hit_tokens']}"
                rows.append([dtype, who, f"{m['tok_s']:.0f}", f"{m['ttft_ms_p50']:.1f}", f"{m['ttft_ms_p99']:.1f}",
                             hits, cell(m["hit_of_ideal"], "{:.0%}")])
        print(f"\nAgentic multi-turn (M: {AGENTIC[0]} conversations x {AGENTIC[1]} turns; ideal: every token of "
              "the previous turn reused)\n" + table(rows))
    if args.long:
        rows = [["dtype", "engine", "prefill tok/s", "of prefill ceiling", "TTFT p50 ms", "TTFT max ms",
                 "streams' ITL p50 ms before", "ITL p50 ms during", "ITL p99 ms during", "p99 / p50"]]
        for dtype, r in results.items():
            for who, get in engines.items():
                x = get(r)["L"]
                ceil = r["ceiling_L_prefill"]
                ratio = x["itl_ms_p99_during"] / x["itl_ms_p50_during"] if x["itl_ms_p50_during"] else None
                rows.append([dtype, who, f"{x['prefill_tok_s']:.0f}", f"{x['prefill_tok_s'] / ceil:.0%}",
                             f"{x['ttft_ms_p50']:.0f}", f"{x['ttft_ms_max']:.0f}",
                             cell(x["itl_ms_p50_before"], "{:.1f}"),
                             cell(x["itl_ms_p50_during"], "{:.1f}"), cell(x["itl_ms_p99_during"], "{:.1f}"),
                             cell(ratio, "{:.1f}x")])
        print(f"\nLong prompts (L: {LONG[0]} x {LONG[1]} tokens, {LONG[2]} new; then again beside {LONG[3]} "
              f"decoding streams)\n" + table(rows))
    _cpu_report(results, args.dtypes)
    print("\nServer ready in: " + ", ".join(f"{d} {r['ready_s']:.1f}s" for d, r in results.items()))


def _cpu_report(results: dict, dtypes: list[str]) -> None:
    """Workload A on CPU time (tokens per CPU second of the server's processes, HF's own process), the load
    average after it, and the ratios within this run: rollbus bf16 over fp32, rollbus over HF."""
    rows = [["dtype", "engine", "A tok/s (wall)", "A tok per CPU s", "load average"]]
    for dtype, r in results.items():
        for who, a in (("rollbus", r["A"]), ("HF", r.get("hf_A"))):
            if a and "cpu_s" in a:
                n = a["tokens"] * (len(a.get("runs", [0])))
                rows.append([dtype, who, f"{a['tok_s']:.0f}", f"{n / a['cpu_s']:.1f}", f"{a['loadavg']:.2f}"])
    print("\nWorkload A on CPU time (the server's process tree; HF's process)\n" + table(rows))
    if "float32" in results and "bfloat16" in results:
        fp, bf = results["float32"], results["bfloat16"]
        cpu = lambda a: a["tokens"] * len(a.get("runs", [0])) / a["cpu_s"]  # noqa: E731
        print(f"rollbus bf16 / fp32, A: {bf['A']['tok_s'] / fp['A']['tok_s']:.2f}x wall, "
              f"{cpu(bf['A']) / cpu(fp['A']):.2f}x CPU time")
        if "hf_A" in bf:
            print(f"rollbus bf16 / HF bf16, A: {bf['A']['tok_s'] / bf['hf_A']['tok_s']:.2f}x wall, "
                  f"{cpu(bf['A']) / cpu(bf['hf_A']):.2f}x CPU time")


def plot(results: dict, path: str) -> None:
    """A bar chart of A (and B) tok/s, rollbus against HF generate, saved to `path` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    labels, ours, theirs = [], [], []
    for dtype, r in results.items():
        for w in ("A", "B")[: 1 + ("B" in r)]:
            labels.append(f"{dtype} {w}")
            ours.append(r[w]["tok_s"])
            theirs.append(r.get(f"hf_{w}", {}).get("tok_s", 0))
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="rollbus")
    ax.bar([i + 0.2 for i in x], theirs, 0.4, label="HF generate")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("useful tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}", file=sys.stderr)
