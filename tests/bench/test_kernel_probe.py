"""bench/credit/kernel_probe.py (issue 77, item 2): each op's checksum sees its op's bytes, one machine gives the same
checksums twice, and the diff names exactly the ops two files disagree on."""

import json
import sys

from conftest import ROOT

sys.path[:0] = [str(ROOT / "bench" / "credit"), str(ROOT / "bench" / "shared")]
import kernel_probe as probe  # noqa: E402


def test_the_same_inputs_give_the_same_checksums_and_other_inputs_move_every_op():
    first, again, other = probe.fingerprint(0), probe.fingerprint(0), probe.fingerprint(1)
    assert first == again
    assert {"matmul", "exp", "sdpa", "linear_backward_adamw", "model_grad"} <= set(first)  # the base is committed
    assert [op for op in first if first[op] == other[op]] == []  # no op's checksum is blind to its bytes


def test_the_diff_names_the_ops_that_differ_and_those_one_file_lacks(tmp_path, capsys):
    ops = probe.fingerprint(0)
    a = {"machine": {"cpu": "cpu A"}, "ops": ops}
    b = {"machine": {"cpu": "cpu B"}, "ops": {**ops, "exp": "0" * 16, "extra": "1" * 16}}
    del b["ops"]["sum"]
    assert probe.diff(a, b) == ["exp", "sum", "extra"]
    for name, d in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    probe.main(["--diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert out.startswith("cpu A against cpu B: 3 of 17 ops differ") and f"exp: {ops['exp']} / {'0' * 16}" in out
