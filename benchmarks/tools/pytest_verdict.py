"""One line per test file from each of pytest's JUnit XML files: how many passed, failed, errored and skipped,
and why each non-passing test did not pass. ``gpu_record.sh pytest`` prints it last, so that a red GPU suite is
seen at a glance.

    python3 benchmarks/tools/pytest_verdict.py run.xml [more.xml ...] [--json verdict.json]

Exit status 1 if any test failed or errored, else 0 (a file whose tests all skipped is reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict
from typing import Dict, List, Optional


def _file_of(case: ET.Element) -> str:
    """``tests/gpu/test_hf.py`` from a testcase's classname ``tests.gpu.test_hf`` (or ``...test_hf.TestX``)."""
    explicit = case.get("file")
    if explicit:
        return explicit
    parts = (case.get("classname") or "?").split(".")
    while len(parts) > 1 and not parts[-1].startswith("test"):
        parts.pop()  # a test class's name
    return "/".join(parts) + ".py"


def _reason(node: ET.Element, outcome: str) -> str:
    """A skip's reason; for a failure, the last ``SomeError: ...`` line of the report (for a test that runs a
    child process, the child's own error, which the assertion's message carries), else the message's first line."""
    text = node.text or "" if outcome != "skipped" else ""
    errors = [m.group(0) for m in re.finditer(r"\b\w*(?:Error|Exception): .+", text)]
    if errors:
        return errors[-1].strip()
    lines = [ln.strip() for ln in (node.get("message") or "").splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _outcome(case: ET.Element) -> tuple:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is not None:
            return outcome, _reason(node, outcome)[:200]
    return "passed", ""


def verdicts(paths: List[str]) -> "OrderedDict[str, Dict]":
    """Per file: counts by outcome and the (name, outcome, reason) of each test that did not pass."""
    files: "OrderedDict[str, Dict]" = OrderedDict()
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, reason = _outcome(case)
            entry = files.setdefault(_file_of(case), {"passed": 0, "failed": 0, "error": 0, "skipped": 0,
                                                      "not_passed": []})
            entry[outcome] += 1
            if outcome != "passed":
                entry["not_passed"].append({"test": case.get("name"), "outcome": outcome, "reason": reason})
    return files


def line(name: str, entry: Dict) -> str:
    bad = entry["failed"] + entry["error"]
    verdict = "RED" if bad else ("green" if entry["passed"] else "skipped")
    counts = ", ".join(f"{entry[k]} {k}" for k in ("passed", "failed", "error", "skipped") if entry[k])
    why = "; ".join(f"{t['test']}: {t['outcome']}: {t['reason']}" for t in entry["not_passed"])
    return f"{verdict:7s} {name}: {counts}" + (f"  [{why}]" if why else "")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("xml", nargs="+", help="pytest --junitxml files")
    p.add_argument("--json", default=None, help="also write the verdicts here")
    args = p.parse_args(argv)
    runs = {path: verdicts([path]) for path in args.xml}
    for path, files in runs.items():
        print(f"== {path}")
        for name, entry in files.items():
            print(line(name, entry))
    everything = [e for files in runs.values() for e in files.values()]
    red = sum(e["failed"] + e["error"] for e in everything)
    total = {k: sum(e[k] for e in everything) for k in ("passed", "failed", "error", "skipped")}
    print(f"{'RED' if red else 'GREEN'}: " + ", ".join(f"{v} {k}" for k, v in total.items())
          + f" over {len(runs)} run(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "total": total, "green": not red}, f, indent=1)
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
