"""Regenerate the README's notebook plots: execute each notebook and save its tagged figures under docs/images/.

A code cell tagged ``readme-image:NAME`` contributes its first PNG output as ``docs/images/NAME.png``. The
notebooks themselves stay output-free in git; only these PNGs are committed.

    python scripts/render_notebook_images.py [NOTEBOOK ...]     # default: every notebooks/*.ipynb
"""

from __future__ import annotations

import argparse
import base64
import pathlib
import sys

import notebook_tools

IMAGES = notebook_tools.ROOT / "docs" / "images"
TAG = "readme-image:"


def tagged_images(nb) -> dict[str, bytes]:
    """NAME -> PNG bytes for every cell tagged readme-image:NAME (an executed notebook)."""
    found = {}
    for i, cell in enumerate(nb.cells):
        for tag in cell.get("metadata", {}).get("tags", []):
            if not tag.startswith(TAG):
                continue
            pngs = [o.data["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            if not pngs:
                raise RuntimeError(f"cell {i} is tagged {tag!r} but produced no PNG")
            found[tag[len(TAG):]] = base64.b64decode(pngs[0])
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=pathlib.Path)
    args = ap.parse_args(argv)
    IMAGES.mkdir(parents=True, exist_ok=True)
    for path in args.paths or notebook_tools.notebooks():
        images = tagged_images(notebook_tools.execute(path))
        for name, png in images.items():
            (IMAGES / f"{name}.png").write_bytes(png)
            print(f"{path.name} -> docs/images/{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
