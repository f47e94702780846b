"""Where a server's Python time goes, from py-spy's raw (collapsed) stacks: each sample to one part of a request by
its stack and leaf frame, first matching rule wins; prints each part's share.

    py-spy record --pid <server pid> --duration 15 --rate 250 --format raw -o profile.txt --nonblocking
    uv run python -m benchmarks cpu-split profile.txt

py-spy samples Python threads only: ONNX Runtime's own pool threads are not in it, the batcher thread that calls
`Session.run` is (its samples are the model's share as seen from the interpreter)."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

Rule = tuple[str, Callable[[str, str], bool]]
RULES: list[Rule] = [
    ("the model (Session.run, batcher thread)",
     lambda stack, leaf: "Session.run" in leaf or ("batcher.py" in stack and "_worker" in leaf)),
    ("decode and framing (libspng, PIL, resize)",
     lambda stack, leaf: "decode_opened" in stack or "peek_images" in stack
     or any(k in leaf for k in ("preprocess.py", "PIL/", "pyspng"))),
    ("multipart split", lambda stack, leaf: "multipart" in leaf),
    ("answer (top-k, orjson)", lambda stack, leaf: "top_classes" in stack or "json_bytes" in leaf),
    ("request id, access log, metrics, drift counts",
     lambda stack, leaf: any(k in leaf for k in ("access.py", "uuid", "prometheus_client", "drift.py"))),
    ("uvicorn + httptools", lambda stack, leaf: any(k in leaf for k in ("uvicorn/", "connection.py", "httptools"))),
    ("Starlette / FastAPI / middleware stack",
     lambda stack, leaf: any(k in leaf for k in ("starlette/", "fastapi/", "anyio/"))),
    ("our handlers, batcher queueing", lambda stack, leaf: "pipeline/serve/" in leaf),
    ("asyncio / uvloop", lambda stack, leaf: "asyncio/" in leaf or "uvloop" in leaf or "Runner.run" in leaf),
    ("thread hand-offs (the batcher's and to_thread's workers)", lambda stack, leaf: leaf.startswith("_worker ")),
]  # fmt: skip


def split(lines: Iterable[str], rules: list[Rule] = RULES) -> Counter[str]:
    """Samples per part; a stack no rule takes counts as `other: <leaf function>`."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        part = next((name for name, matches in rules if matches(stack, leaf)), None)
        counts[part or "other: " + leaf.split(" (")[0][:60]] += int(count)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy record --format raw output")
    args = parser.parse_args(argv)
    counts = split(args.profile.read_text().splitlines())
    total = sum(counts.values())
    if not total:
        raise SystemExit(f"{args.profile}: no samples (py-spy's raw format: 'frame;frame;... count' lines)")
    small = [name for name, n in counts.items() if name.startswith("other: ") and n / total < 0.005]
    rest = sum(counts.pop(name) for name in small)
    for name, n in counts.most_common():
        print(f"{100 * n / total:5.1f} %  {name}")
    if rest:
        print(f"{100 * rest / total:5.1f} %  other ({len(small)} functions under 0.5 % each)")
    print(f"{total} samples")


if __name__ == "__main__":
    main()
