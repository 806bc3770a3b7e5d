r"""Cross-check our MATH500 grading (math-verify on the last ``\boxed{}``) against lm-eval's ``minerva_math``.

For every MATH500 problem (or a seeded subsample, ``--problems N``) it builds completions of several kinds:
``solution`` (the reference solution, with its ``\boxed{}``), ``boxed`` (``\boxed{answer}`` alone), ``minerva``
(lm-eval's few-shot format ``Final Answer: The final answer is $X$. I hope it is correct.``), ``equiv_boxed`` /
``equiv_minerva`` (an equivalent rewriting of the answer, e.g. ``\frac{1}{2}`` -> ``0.5``, when a rule applies)
and ``wrong_boxed`` / ``wrong_minerva`` (a wrong answer). Each is graded by our ``math500`` task and by
lm-eval's ``lm_eval.tasks.minerva_math.utils.process_results`` (metrics ``exact_match`` and ``math_verify``;
the doc built by its ``process_docs``, so lm-eval's gold is the Minerva-normalised last ``\boxed{}`` of the
solution). It prints pass rates and agreement per metric and completion kind, and categorised disagreements.

lm-eval's ``exact_match`` compares with ``sympy.parsing.latex.parse_latex``, which needs
``antlr4-python3-runtime==4.11`` (lm-eval asserts it on import) while math-verify pins 4.13.2. The lm-eval side
therefore runs in worker subprocesses with an antlr 4.11 copy first on ``PYTHONPATH``; create it once with
``.venv/bin/pip install --no-deps --target .cache/antlr4-4.11 antlr4-python3-runtime==4.11.1``. Our side runs
in this process with the project's own packages.

Usage: ``python benchmarks/lm_eval_crosscheck.py [--data-dir ../shared/data] [--problems N] [--workers 2]
[--examples 3] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MINERVA = "Final Answer: The final answer is ${}$. I hope it is correct."
LM_METRICS = ("exact_match", "math_verify")


@dataclass
class Item:
    """One completion to grade, with what it was built from."""

    problem_id: str
    kind: str
    rule: str  # the rewriting rule of equiv_* kinds, else ""
    completion: str
    answer: str  # MATH500 `answer` field (our gold before cleaning)


# --------------------------------------------------------------------------- completions

_INT = re.compile(r"-?\d+")
_FRAC = re.compile(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_DEC = re.compile(r"-?\d*\.\d+")


def _terminates(denominator: int) -> bool:
    """True when 1/denominator has a finite decimal expansion."""
    for p in (2, 5):
        while denominator % p == 0:
            denominator //= p
    return denominator == 1


def rewrite(answer: str) -> tuple[str, str] | None:
    """(rule, an equivalent rewriting of ``answer``) for the first rule that applies, else None."""
    a = answer.strip()
    if m := _FRAC.fullmatch(a):
        sign, num, den = m.group(1), int(m.group(2)), int(m.group(3))
        if den and _terminates(den):
            return "frac_to_decimal", f"{sign}{float(Fraction(num, den))!r}"
        return "frac_to_slash", f"{sign}{num}/{den}"
    if "\\dfrac" in a:
        return "dfrac_to_frac", a.replace("\\dfrac", "\\frac")
    if _DEC.fullmatch(a):
        f = Fraction(a)
        return "decimal_to_frac", f"{'-' if f < 0 else ''}\\frac{{{abs(f.numerator)}}}{{{f.denominator}}}"
    if _INT.fullmatch(a):
        n = int(a)
        return ("thousands_commas", f"{n:,}") if abs(n) >= 1000 else ("integer_as_float", f"{n}.0")
    if "\\left" in a or "\\right" in a:
        return "drop_left_right", a.replace("\\left", "").replace("\\right", "")
    if re.search(r"\^\\circ|\^\{\\circ\}", a):
        return "drop_degrees", re.sub(r"\^\\circ|\^\{\\circ\}", "", a)
    if m := re.fullmatch(r"\\text\{([^{}]*)\}", a):
        return "drop_text", m.group(1)
    if "\\sqrt{" in a and re.search(r"\\sqrt\{(\w)\}", a):
        return "sqrt_shorthand", re.sub(r"\\sqrt\{(\w)\}", r"\\sqrt\1", a)
    return None


def wrong(answer: str) -> str:
    """A non-equivalent answer: an integer plus one, else the answer plus one."""
    a = answer.strip()
    return str(int(a) + 1) if _INT.fullmatch(a) else f"{a}+1"


def build_items(rows: list[dict]) -> list[Item]:
    """Every completion kind for every row (equiv_* only when a rewriting rule applies)."""
    items = []
    for r in rows:
        pid, ans = r["unique_id"], r["answer"]
        items += [
            Item(pid, "solution", "", r["solution"], ans),
            Item(pid, "boxed", "", f"\\boxed{{{ans}}}", ans),
            Item(pid, "minerva", "", MINERVA.format(ans), ans),
        ]
        rewritten = rewrite(ans)
        if rewritten:
            rule, text = rewritten
            items += [
                Item(pid, "equiv_boxed", rule, f"\\boxed{{{text}}}", ans),
                Item(pid, "equiv_minerva", rule, MINERVA.format(text), ans),
            ]
        bad = wrong(ans)
        items += [Item(pid, "wrong_boxed", "", f"\\boxed{{{bad}}}", ans), Item(pid, "wrong_minerva", "", MINERVA.format(bad), ans)]
    return items


# --------------------------------------------------------------------------- the lm-eval side (worker subprocess)


def worker() -> None:
    """Read [(row, completion)] JSON on stdin; print one JSON result per line (lm-eval's metrics, its gold, or the error)."""
    import datasets
    import lm_eval.tasks.minerva_math.utils as minerva

    datasets.disable_progress_bars()
    jobs = json.load(sys.stdin)
    rows = {j["row"]["unique_id"]: j["row"] for j in jobs}
    ids = list(rows)
    docs = minerva.process_docs(datasets.Dataset.from_list([{"problem": rows[i]["problem"], "solution": rows[i]["solution"]} for i in ids]))
    doc_of = dict(zip(ids, docs))
    for job in jobs:
        doc = doc_of[job["row"]["unique_id"]]
        out: dict = {"gold": doc["answer"], "answer_norm": minerva.normalize_final_answer(job["row"]["answer"])}
        try:
            out.update(minerva.process_results(doc, [job["completion"]]))
            out["extracted"] = minerva.normalize_final_answer(minerva.get_unnormalized_answer(job["completion"]))
            out["sympy"] = [_parsed(minerva, out["extracted"]), _parsed(minerva, doc["answer"])]
        except Exception as exc:  # noqa: BLE001 - recorded as an lm-eval scoring error
            out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)


def _parsed(minerva, latex: str) -> str:
    """What lm-eval's exact_match compares: ``sympy.parsing.latex.parse_latex`` of the text (or the error)."""
    try:
        with minerva.timeout(seconds=5):
            return str(minerva.parse_latex(latex))
    except Exception as exc:  # noqa: BLE001
        return f"<{type(exc).__name__}>"


def start_workers(jobs: list[dict], n: int, antlr_dir: Path) -> list[tuple[subprocess.Popen, int, int]]:
    """Start ``n`` worker subprocesses on contiguous slices of the jobs (antlr 4.11 first on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(antlr_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    size = -(-len(jobs) // n)
    procs = []
    for start in range(0, len(jobs), size):
        part = jobs[start : start + size]
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        proc.stdin.write(json.dumps(part))
        proc.stdin.close()
        procs.append((proc, start, len(part)))
    return procs


def collect_workers(procs: list[tuple[subprocess.Popen, int, int]], total: int) -> list[dict]:
    """Wait for the workers and return their results in job order; a crashed worker is a clear error."""
    results: list[dict] = [{} for _ in range(total)]
    for proc, start, count in procs:
        lines = proc.stdout.read().splitlines()
        proc.wait()
        if proc.returncode != 0 or len(lines) != count:
            raise SystemExit(f"lm-eval worker failed (exit {proc.returncode}, {len(lines)}/{count} results):\n{proc.stderr.read()[-3000:]}")
        for offset, line in enumerate(lines):
            results[start + offset] = json.loads(line)
    return results


# --------------------------------------------------------------------------- comparison

VARIANTS = {"gold": ("boxed", "minerva"), "equiv": ("equiv_boxed", "equiv_minerva"), "wrong": ("wrong_boxed", "wrong_minerva")}


def passed(result: dict, metric: str | None = None) -> bool:
    """Our status is pass (metric None), or lm-eval's metric is 1."""
    return result.get("status") == "pass" if metric is None else result.get(metric) == 1


def rate(values: list[bool]) -> str:
    return f"{sum(values) / len(values):.3f}" if values else "-"


def format_table(items: list[Item], ours: list[dict], lm: list[dict]) -> dict:
    """Pass rates and agreement per completion kind, each grader on the same text."""
    kinds = list(dict.fromkeys(i.kind for i in items))
    table: dict = {}
    print(f"{'kind':<15}{'n':>6}{'ours':>8}{'lm em':>8}{'lm mv':>8}{'agree em':>10}{'agree mv':>10}{'lm err':>8}{'our err':>9}")
    for kind in [*kinds, "ALL"]:
        idx = [n for n, i in enumerate(items) if kind in ("ALL", i.kind)]
        o = [passed(ours[n]) for n in idx]
        em = [passed(lm[n], "exact_match") for n in idx]
        mv = [passed(lm[n], "math_verify") for n in idx]
        row = {
            "n": len(idx), "ours": rate(o), "lm_em": rate(em), "lm_mv": rate(mv),
            "agree_em": rate([a == b for a, b in zip(o, em)]), "agree_mv": rate([a == b for a, b in zip(o, mv)]),
            "lm_errors": sum("error" in lm[n] for n in idx), "our_errors": sum(ours[n]["status"] == "error" for n in idx),
        }  # fmt: skip
        table[kind] = row
        print(f"{kind:<15}{row['n']:>6}{row['ours']:>8}{row['lm_em']:>8}{row['lm_mv']:>8}{row['agree_em']:>10}{row['agree_mv']:>10}{row['lm_errors']:>8}{row['our_errors']:>9}")
    return table


def answer_category(variant: str, rule: str, ours_pass: bool, lm_pass: bool, metric: str, lm: dict, ours: dict) -> str:
    """Why two graders, each shown the answer in its own format, disagree (a short reason label)."""
    tag = f" [{rule}]" if rule else ""
    if ours["status"] == "error":
        return "our grader errored"
    if "error" in lm:
        return f"lm-eval scoring raised ({lm['error'].split(':')[0]})"
    if variant == "wrong":
        if ours_pass:
            return "false positive of ours"
        pred, gold = lm.get("sympy", [None, None])
        if metric == "exact_match" and pred == gold and lm.get("extracted") != lm["gold"]:
            return "false positive of lm-eval exact_match: parse_latex reads both as the same expression (it drops an unparsed tail)"
        return f"false positive of lm-eval {metric}"
    if lm["gold"] != lm["answer_norm"] and not lm_pass:
        return f"lm-eval gold (normalised last box of the solution) differs from the answer field{tag}"
    if lm_pass:
        return f"ours rejects an answer lm-eval {metric} accepts{tag}"
    return f"lm-eval {metric} rejects an answer ours accepts{tag}"


def answer_level(items: list[Item], ours: list[dict], lm: list[dict], examples: int) -> dict:
    """Each grader on the answer in its own format: ours on \\boxed{X}, exact_match on the Minerva line, math_verify on both."""
    at: dict[tuple[str, str], int] = {(i.problem_id, i.kind): n for n, i in enumerate(items)}
    pids = list(dict.fromkeys(i.problem_id for i in items))
    out: dict = {"rates": {}, "disagreements": {}}
    print(
        f"\n{'answer':<8}{'n':>6}{'ours@box':>10}{'em@minerva':>12}{'mv@box':>8}{'mv@minerva':>12}"
        f"{'agree ours/em':>15}{'agree ours/mv':>15}"
    )
    cats: dict[str, dict[str, list[tuple[int, int]]]] = {"exact_match": defaultdict(list), "math_verify": defaultdict(list)}
    for variant, (boxed_kind, minerva_kind) in VARIANTS.items():
        pairs = [(at[(p, boxed_kind)], at[(p, minerva_kind)]) for p in pids if (p, boxed_kind) in at]
        o = [passed(ours[b]) for b, _ in pairs]
        em = [passed(lm[m], "exact_match") for _, m in pairs]
        mvb = [passed(lm[b], "math_verify") for b, _ in pairs]
        mvm = [passed(lm[m], "math_verify") for _, m in pairs]
        row = {"n": len(pairs), "ours_boxed": rate(o), "em_minerva": rate(em), "mv_boxed": rate(mvb), "mv_minerva": rate(mvm),
               "agree_ours_em": rate([a == b for a, b in zip(o, em)]), "agree_ours_mv": rate([a == b for a, b in zip(o, mvb)])}  # fmt: skip
        out["rates"][variant] = row
        print(f"{variant:<8}{row['n']:>6}{row['ours_boxed']:>10}{row['em_minerva']:>12}{row['mv_boxed']:>8}{row['mv_minerva']:>12}{row['agree_ours_em']:>15}{row['agree_ours_mv']:>15}")
        for (b, m), ob, e, v in zip(pairs, o, em, mvb):
            rule = items[b].rule
            if ob != e:
                cats["exact_match"][answer_category(variant, rule, ob, e, "exact_match", lm[m], ours[b])].append((b, m))
            if ob != v:
                cats["math_verify"][answer_category(variant, rule, ob, v, "math_verify", lm[b], ours[b])].append((b, b))
    for metric, found in cats.items():
        ordered = sorted(found.items(), key=lambda kv: -len(kv[1]))
        out["disagreements"][metric] = {c: len(v) for c, v in ordered}
        shown = "the Minerva line" if metric == "exact_match" else "\\boxed{X}"
        print(f"\nanswer-level disagreements, ours on \\boxed{{X}} vs lm-eval {metric} on {shown}: {sum(len(v) for v in found.values())}")
        for cat, pairs in ordered:
            print(f"  {len(pairs):>5}  {cat}")
            for b, m in pairs[:examples]:
                it = items[b]
                print(
                    f"         {it.problem_id} answer={it.answer!r} lm_gold={lm[m].get('gold')!r} boxed={it.completion!r}\n"
                    f"           ours={ours[b]['status']} ({ours[b]['detail']}) "
                    f"lm={ {k: lm[m][k] for k in (*LM_METRICS, 'extracted', 'sympy', 'error') if k in lm[m]} }"
                )
    return out


def report(items: list[Item], ours: list[dict], lm: list[dict], examples: int) -> dict:
    """Print both views (same text; each grader's own format) and return them as a dict."""
    summary: dict = {"n_items": len(items), "n_problems": len({i.problem_id for i in items})}
    summary["by_kind"] = format_table(items, ours, lm)
    summary["answer_level"] = answer_level(items, ours, lm, examples)
    rules = Counter(i.rule for i in items if i.kind == "equiv_boxed")
    summary["equiv_rules"] = dict(rules.most_common())
    print(f"\nequivalent rewritings used: {', '.join(f'{r} {c}' for r, c in rules.most_common())}")
    summary["golds_differ"] = sum(1 for n, i in enumerate(items) if i.kind == "boxed" and lm[n]["gold"] != lm[n]["answer_norm"])
    print(
        "problems whose lm-eval gold (Minerva-normalised last box of the solution) differs from the normalised answer field: "
        f"{summary['golds_differ']}"
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--problems", type=int, default=None, help="seeded random subsample of N problems (default: all 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="lm-eval worker subprocesses")
    parser.add_argument(
        "--antlr411", type=Path, default=ROOT / ".cache" / "antlr4-4.11", help="a pip --target dir holding antlr4-python3-runtime 4.11"
    )
    parser.add_argument("--examples", type=int, default=3, help="examples printed per disagreement category")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary and every graded item here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    if not (args.antlr411 / "antlr4").is_dir():
        raise SystemExit(
            f"{args.antlr411} holds no antlr4 4.11 (lm-eval's minerva exact_match needs it); create it with:\n"
            f"  {sys.executable} -m pip install --no-deps --target {args.antlr411} antlr4-python3-runtime==4.11.1"
        )
    sys.path.insert(0, str(ROOT))
    from opd_harness.registry import TASKS

    path = args.data_dir / "math500" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if args.problems:
        rows = random.Random(args.seed).sample(rows, min(args.problems, len(rows)))
    items = build_items(rows)
    row_of = {r["unique_id"]: r for r in rows}
    started = time.perf_counter()
    procs = start_workers([{"row": row_of[i.problem_id], "completion": i.completion} for i in items], args.workers, args.antlr411)
    task = TASKS.get("math500")()
    problems = {p.id: p for p in task.load("test", args.data_dir)}
    scores = task.grade_many([problems[i.problem_id] for i in items], [i.completion for i in items])
    ours = [{"status": s.status, "extracted": s.extracted, "detail": s.details} for s in scores]
    ours_s = time.perf_counter() - started
    lm = collect_workers(procs, len(items))
    seconds = time.perf_counter() - started
    print(
        f"MATH500 {path}: {len(rows)} problems, {len(items)} completions; "
        f"ours {ours_s:.0f}s, total {seconds:.0f}s ({args.workers} lm-eval workers)\n"
    )
    summary = report(items, ours, lm, args.examples)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"summary": summary, "items": [{**asdict(i), "ours": o, "lm_eval": m} for i, o, m in zip(items, ours, lm)]}, indent=1
            )
        )


if __name__ == "__main__":
    main()
