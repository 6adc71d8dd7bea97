"""bench/mutants/mutants.py (issue 68) still finds what it mutates: every target's functions, each defined once, and every
hand-written mutant's text, in exactly one place (code moved between files keeps both); ids are unique, and a
mutant changes its file."""

import importlib.util
import sys

from conftest import ROOT


def test_every_mutant_finds_its_code(capsys):
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "bench" / "mutants" / "mutants.py")
    mutants = sys.modules["mutants"] = importlib.util.module_from_spec(spec)  # (its dataclass looks itself up)
    spec.loader.exec_module(mutants)
    found = [m for t in mutants.TARGETS for m in mutants.automatic(t)] + mutants.manual()  # exits where one is lost
    assert len({m.id for m in found}) == len(found) > 600
    assert {m.id.split(":")[0] for m in found} == {*mutants.TARGETS, "manual"}
    for m in found[::50] + mutants.manual():
        clean = (ROOT / m.file).read_bytes()
        changed = clean.replace(m.old.encode(), m.new.encode(), 1) if m.start == m.end else mutants.splice(clean, m)
        assert changed != clean and m.old, m.id
    mutants.main(["--list", "--targets", "manual"])
    assert capsys.readouterr().out.endswith(f"{len(mutants.MANUAL)} mutants\n")
