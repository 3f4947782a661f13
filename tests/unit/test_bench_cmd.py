"""``moeify bench --json``: the results file of a run cut short keeps the shapes it finished."""

import json

import pytest

from moeify.cli.main import main


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cmoe"
    assert main(["convert", "--method", "cmoe", "--out", str(out), "--set", "spec=S1A1E8", "--no-speed"]) == 0
    return out


def test_bench_json_keeps_the_shapes_done_when_the_run_is_cut_short(converted, tmp_path, monkeypatch):
    import moeify.evaluation.bench as bench

    class CutShort(Exception):
        pass

    def cut(*args, **kwargs):
        raise CutShort
    out = tmp_path / "bench.json"
    flags = ["bench", str(converted), "--prefill", "1x16", "--decode", "1", "--new-tokens", "2", "--repeats", "1",
             "--json", str(out), "--overwrite"]
    with monkeypatch.context() as patch:
        patch.setattr(bench, "decode_speed", cut)
        with pytest.raises(CutShort):
            main(flags)
    partial = json.loads(out.read_text())
    assert partial["partial"] and [p["seq_len"] for p in partial["prefill"]] == [16] and partial["decode"] == []
    assert main(flags) == 0
    done = json.loads(out.read_text())
    assert "partial" not in done and [d["batch_size"] for d in done["decode"]] == [1]
