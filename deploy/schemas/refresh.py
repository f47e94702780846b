"""Regenerate a schema here from a CRD file of its project (see README.md): the served version's
openAPIV3Schema, descriptions dropped, the subtrees named by --prune replaced by an open object.

    python deploy/schemas/refresh.py CRD.yaml VERSION OUT.json [--prune spec.canary,spec.explainer,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("crd", type=Path)
    parser.add_argument("version")
    parser.add_argument("out", type=Path)
    parser.add_argument("--prune", default="", help="comma-separated dotted paths under the schema's properties")
    args = parser.parse_args()
    crd = yaml.safe_load(args.crd.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    schema = strip(version["schema"]["openAPIV3Schema"])
    pruned = [p for p in args.prune.split(",") if p]
    for path in pruned:
        *parents, leaf = path.split(".")
        node = schema
        for key in parents:
            node = node["properties"][key]
        node["properties"][leaf] = OPEN
    schema["$comment"] = (
        f"{crd['spec']['names']['kind']} {crd['spec']['group']}/{args.version} from {args.crd.name}; "
        f"pruned to open objects: {', '.join(pruned) or 'nothing'}"
    )
    args.out.write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
