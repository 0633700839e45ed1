"""Write the OpenAPI documents of the control plane and the node agent to spec/.

    python scripts/export_openapi.py          # rewrite spec/api.openapi.json and spec/node.openapi.json
    python scripts/export_openapi.py --check  # exit 1 if the files differ from the code
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "spec"


def documents() -> dict[str, dict[str, Any]]:
    from capsa.common.image import GuestImage
    from capsa.control.app import create_app
    from capsa.node.agent.agent import NodeAgent
    from capsa.node.agent.capacity import NodeCapacity
    from capsa.node.api.app import create_node_app

    class _NoRuntime:  # the schema does not depend on the runtime; nothing is ever booted here
        name = "none"

    image = GuestImage(kernel=Path("/"), initrd=Path("/"), rootfs=Path("/"), digest="", kernel_release="")
    agent = NodeAgent(_NoRuntime(), image, capacity=NodeCapacity(0, 0, 0))  # type: ignore[arg-type]
    # Routes only reach the agent when called: the plain agent is enough to describe them all.
    node_app = create_node_app(agent, "x" * 16)
    return {
        "api.openapi.json": create_app().openapi(),
        "node.openapi.json": node_app.openapi(),
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    drift = []
    for name, document in documents().items():
        path = SPEC / name
        text = render(document)
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(name)
        else:
            SPEC.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if drift:
        print(f"out of date: {', '.join(drift)} (run python scripts/export_openapi.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
