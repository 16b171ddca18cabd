"""What scripts/gpu/gpu_run.sh says about a step once it ended (standard library only).

    python scripts/gpu/gpu_result.py STEP RESULT_FILE STATUS [LOG]

Makes sure RESULT_FILE exists and says how the step ended: a JSON result gets a "status" key
(and, unless the step ended "ok", "log_tail": the last 40 lines of the step's log); a missing JSON
result is written as {"step", "status", "log_tail"}; a text result (tests.log) gets a last line
"status: ...". Then prints one line for run.log: the status and the step's headline numbers
(the diagnostic verdict, identity counts, the slots' identity and speed, r(k), overhead times,
bench ratios, pytest's summary).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def tail(path, n=40) -> list:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-n:]
    except (OSError, TypeError):
        return []


def headline(step: str, data) -> str:
    """The numbers worth a glance, from a step's result; "" when there are none."""
    try:
        if step == "diagnose":
            cases = ", ".join(f"{c} {r['status']}" for c, r in data.get("cases", {}).items())
            return f"{cases}. verdict: {data.get('verdict', '')}"
        if step == "identity":
            parts = [f"{i['model']}: " + ", ".join(
                         f"{mode} {i[mode]['identical']}/{i['prompts']} identical"
                         + (f" (gaps {[d['top2_gap'] for d in i[mode]['diverged']]})"
                            if i[mode]["diverged"] else "")
                         for mode in i if mode == "ngram" or mode.startswith("scripted-k"))
                     for i in data.get("identity", [])]
            parts += [f"{r['model']}: batch rows equal to one-token decodes at n = "
                      f"{[int(n) for n, v in r['by_n'].items() if v['identical_rows'] == int(n)]}"
                      f" of 2-{max(int(n) for n in r['by_n'])} (largest difference "
                      f"{max(v['max_abs_diff'] for v in r['by_n'].values())})"
                      for r in data.get("rows", [])]
            return "; ".join(parts)
        if step == "exact":
            costs = "; ".join(
                f"{c['model']} r(1, 2, 4, 8, 16) limit {'on' if c['exact'] else 'off'}: "
                + " ".join(f"{c['ratios'][k]:.2f}" for k in (1, 2, 4, 8, 16)
                           if k < len(c["ratios"]))
                for c in data.get("curves", []))
            return "; ".join(p for p in (headline("identity", data), costs) if p)
        if step == "parallel":
            p = data["parallel"]
            return (f"{p['slots']} slots: {p['identical']}/{p['prompts']} identical to their lone"
                    f" run, {p['slots_tps']} against {p['alone_tps']} tok/s one at a time "
                    f"({p['speedup']}x)" + (f", errors: {p['errors']}" if p["errors"] else ""))
        if step == "qwen":
            over = headline("overhead", data.get("overhead") or {})
            return headline("curve", data) + (f"; overhead: {over}" if over else "")
        if step == "curve":
            parts = [f"{c['model']}{'' if c.get('graphs', True) else ' (graphs off)'}: "
                     f"{c['ms_per_step']} ms/step, r(k) "
                     + " ".join(f"{r:.2f}" for r in c["ratios"]) for c in data.get("curves", [])]
            if data.get("draft"):
                parts.append(f"draft {data['draft']['cost_in_target_steps']} target steps, "
                             f"can pay: {data['draft']['draft_can_pay']}")
            return "; ".join(parts)
        if step == "overhead":
            argmax = data.get("argmax") or {}
            rows = data.get("rows", []) + [r for r in argmax.get("rows", [])
                                           if r["step"] == "argmax"]
            line = "; ".join(f"{r['step']} k={r['k']} {r['mode']}: device {r['device_ms']:.2f} ms,"
                             f" overhead {r['overhead_ms']:.2f} ms" for r in rows)
            return line + ("" if argmax.get("status", "ok") == "ok"
                           else f"; device argmax: {argmax['status']}")
        if step == "bench":
            return "; ".join(f"{s['mode']} {s['decode_tps']} tok/s" + (
                "" if s["mode"] == "plain" else f", {s['geomean_ratio']}x plain, "
                f"{s['identical']}/{s['compared']} identical")
                for s in data.get("summary", []) if s.get("kind") == "all")
        if step == "llamacpp":
            over = "; ".join(f"{v['mode']} over llama.cpp's best {v['vs_best']}"
                             for v in data.get("versus_llamacpp", []) if v.get("kind") == "all")
            return "; ".join(p for p in (headline("bench", data), over) if p)
    except (KeyError, TypeError, AttributeError) as e:
        return f"(result unreadable: {e!r})"
    return ""


def main(argv) -> int:
    step, result, status = argv[:3]
    log = argv[3] if len(argv) > 3 else None
    path = Path(result)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {"result": data}
        except (OSError, ValueError):
            data = {"step": step}
        data["status"] = status
        if status != "ok":
            data["log_tail"] = tail(log)
        path.write_text(json.dumps(data, indent=1))
        line = headline(step, data)
    else:
        text = path.read_text(errors="replace") if path.exists() else ""
        if not text and status != "ok":
            text = "\n".join(tail(log)) + "\n"
        path.write_text(text + f"status: {status}\n")
        summary = [ln for ln in text.splitlines() if re.search(      # pytest's last line, -q or not
            r"\b(passed|failed|errors?|skipped|deselected)\b.* in [0-9.]+s", ln)]
        line = summary[-1].strip("= ") if summary else ""
    print(f"{step}: {status}" + (f"; {line}" if line else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
