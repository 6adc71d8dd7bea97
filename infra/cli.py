"""--help and --task: the stage scripts' command lines, one parser shape for all four (parser: the docstring's first
paragraph as the description, each flag's default after its one-line help) and one renderer of their --task presets
(presets_table), printed under --help. A flag given explicitly always wins over its preset.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help (none where the default is None or the help states it), the epilog as
    written."""

    def _get_help_string(self, action):
        if "default:" in (action.help or "") or action.default in (None, argparse.SUPPRESS) or action.default is False:
            return action.help
        return super()._get_help_string(action)


def cell(value) -> str:
    return "none" if value is None else repr(value) if value == "" else str(value)


def presets_table(columns: dict[str, dict], notes: str = "") -> str:
    """The epilog: one row per preset key (as its flag), one column per preset, `notes` under it."""
    keys = list(dict.fromkeys(k for col in columns.values() for k in col))
    rows = [["", *columns]] + [
        [f"--{k.replace('_', '-')}", *(cell(col.get(k, "")) for col in columns.values())] for k in keys
    ]
    widths = [max(len(r[c]) for r in rows) + 2 for c in range(len(rows[0]))]
    table = "\n".join("  " + "".join(f"{c:{w}s}" for c, w in zip(r, widths)).rstrip() for r in rows)
    return f"presets (--task picks a column; a flag given explicitly wins):\n{table}" + (f"\n{notes}" if notes else "")


def parser(doc: str, columns: dict[str, dict], notes: str = "") -> argparse.ArgumentParser:
    """An ArgumentParser: the description is the docstring's first paragraph, the epilog the presets' table."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=HelpFormatter, epilog=presets_table(columns, notes)
    )
