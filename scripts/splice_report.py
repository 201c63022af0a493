"""Put a benchmark stage's tables into BENCHMARKS.md.

    python scripts/splice_report.py RUN/main/report.md "## 3." [BENCHMARKS.md]

Replaces everything from the first `###` line after the section whose header starts with the given
prefix up to the next `## ` header with the report's tables (its `##` headers become `###`). The
section's own prose (before its first `###`) is left for a person to update; image lines stay.
"""

import sys
from pathlib import Path


def splice(report: str, doc: str, section: str) -> str:
    lines = doc.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(section))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    first = next((i for i in range(start + 1, end) if lines[i].startswith("### ")), end)
    body = report.split("\n## ", 1)[1] if "\n## " in report else ""
    tables = ("### " + body.replace("\n## ", "\n### ")).strip().splitlines() if body else []
    images = [l for l in lines[first:end] if l.startswith("![")]  # plots stay below the tables
    tail = [""] + [x for l in images for x in (l, "")]
    return "\n".join(lines[:first] + tables + tail + lines[end:]) + "\n"


if __name__ == "__main__":
    report, section = Path(sys.argv[1]).read_text(), sys.argv[2]
    doc_path = Path(sys.argv[3] if len(sys.argv) > 3 else "BENCHMARKS.md")
    doc_path.write_text(splice(report, doc_path.read_text(), section))
