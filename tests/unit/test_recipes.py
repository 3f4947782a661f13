"""Recipes: each paper's table as rows of methods and options, validated before any work, run by
``moeify compare --recipe`` and printed beside the paper's figures."""

import importlib
import json

import pytest

from moeify.cli.compare_cmd import recipe_targets, split_options
from moeify.cli.main import main
from moeify.recipes import check_recipe, load_recipe, recipe_names
from moeify.recipes.table import ordering, recipe_table, row_results

CONVERT = importlib.import_module("moeify.api.convert")  # the module, which the package's function shadows
STATIC = {"active_ratio": 0.5, "attention": "off", "calib_samples": 4, "seq_len": 32}


def recipe(**changes):
    base = {"title": "Test, Table 1: static pruning at two budgets", "paper": "static_prune", "source": "Table 1",
            "model": "embedded:stories260K", "setting": "a test", "metric": "wikitext2_ppl", "lower_is_better": True,
            "columns": {"wikitext2_ppl": "WikiText-2", "avg": "Avg"}, "dense": {"wikitext2_ppl": 5.0},
            "rows": [{"name": "half", "label": "50 %", "method": "static_prune", "options": STATIC,
                      "paper": {"wikitext2_ppl": 9.0, "avg": 50.0}},
                     {"name": "most", "label": "80 %", "method": "static_prune",
                      "options": {**STATIC, "active_ratio": 0.8}, "paper": {"wikitext2_ppl": 6.0}},
                     {"name": "other_paper", "label": "LLM-Pruner", "method": None, "paper": {"wikitext2_ppl": 7.0}}]}
    return {**base, **changes}


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_is_valid_and_names_its_papers_figures(name):
    shipped = load_recipe(name)
    assert shipped.runs and shipped.metric in shipped.columns and shipped.model
    assert all(set(row.paper) <= set(shipped.columns) for row in shipped.rows), name
    assert set(shipped.dense) <= set(shipped.columns)
    assert any(shipped.metric in row.paper for row in shipped.runs)  # an ordering to compare


def test_the_papers_headline_tables_are_shipped():
    assert {"cmoe_table1", "more_table1", "more_table10", "tomoe_table1", "tomoe_table13", "dsmoe_table3",
            "dsmoe_table4", "dense2moe_table2", "dense2moe_table5"} <= set(recipe_names())


def test_a_bad_recipe_is_refused_in_one_line_naming_the_row():
    with pytest.raises(ValueError, match="recipe r.json: needs the keys .*; missing: metric"):
        check_recipe({k: v for k, v in recipe().items() if k != "metric"}, "r.json")
    bad_option = recipe(rows=[{"name": "x", "method": "static_prune", "options": {"active_ratio": 2}}])
    with pytest.raises(ValueError, match=r"recipe r.json, row x: active_ratio=2.* out of range"):
        check_recipe(bad_option, "r.json")
    with pytest.raises(ValueError, match="row x: unknown method 'nope'"):
        check_recipe(recipe(rows=[{"name": "x", "method": "nope"}]), "r.json")
    with pytest.raises(ValueError, match="row name 'x' must be unique"):
        check_recipe(recipe(rows=[{"name": "x", "method": "teal"}, {"name": "x", "method": "teal"}]), "r.json")
    with pytest.raises(ValueError, match="neither a shipped recipe .* nor a file"):
        load_recipe("no_such_recipe")


def test_ordering_counts_the_pairs_in_the_papers_order():
    table = check_recipe(recipe(), "r")
    same = ordering(table, {"half": {"ppl": 30.0}, "most": {"ppl": 12.0}})
    assert same.startswith("Ordering: 1 of 1 pairs of rows in the paper's order") and "same" in same
    swapped = ordering(table, {"half": {"ppl": 10.0}, "most": {"ppl": 12.0}})
    assert "0 of 1 pairs" in swapped and "moeify, best first: half > most" in swapped
    assert "the paper, best first: most > half" in swapped


def test_a_method_prefix_sets_every_row_even_one_named_as_the_method():
    rows = recipe()["rows"]
    named = check_recipe(recipe(rows=[{**rows[0], "name": "static_prune"}, rows[1]]), "r")
    targets = recipe_targets(named)
    assert targets["static_prune"] == ["static_prune", "most"]
    per_run, _ = split_options({"most.seq_len": "8", "static_prune.seq_len": "16"}, targets)
    assert per_run == {"static_prune": {"seq_len": "16"}, "most": {"seq_len": "8"}}  # the row's own value wins


def test_a_row_that_failed_shows_its_error_and_leaves_the_ordering():
    table = recipe_table(check_recipe(recipe(), "r"), {"half": {"error": "APR 0.5 not reachable"}}, "m")
    half = next(line for line in table.splitlines() if line.startswith("| half |"))
    assert "failed: APR 0.5 not reachable" in half and "| 9.00 | 50.00 |" in half
    assert "Fewer than two rows" in table


def test_compare_runs_a_recipe_and_prints_it_beside_the_papers_figures(tmp_path, capsys, monkeypatch):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe()))
    out = tmp_path / "cmp"
    evaluated = []
    measure = CONVERT.perplexity
    monkeypatch.setattr(CONVERT, "perplexity", lambda model, *a, **k: evaluated.append(model) or measure(model, *a, **k))
    assert main(["compare", "--recipe", str(path), "--out", str(out), "--set", "most.calib_samples=2",
                 "--set", "static_prune.seq_len=16"]) == 0
    assert len(evaluated) == 2  # each row's MoE model; the dense one was measured once, by compare
    records = [json.loads((out / row / "record.json").read_text()) for row in ("half", "most")]
    assert records[0]["metrics"]["dense_eval"] == records[1]["metrics"]["dense_eval"]
    summaries = json.loads((out / "compare.json").read_text())
    assert [s["row"] for s in summaries] == ["half", "most"]
    assert summaries[1]["options"]["calib_samples"] == "2" and summaries[0]["options"]["calib_samples"] == 4
    assert all(s["options"]["seq_len"] == "16" for s in summaries)  # a method's value reaches all its rows
    table = (out / "recipe.md").read_text()
    assert table.startswith("## Test, Table 1: static pruning at two budgets")
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["other_paper"].count("not in moeify") == 1 and "7.00" in rows["other_paper"]
    assert "| 9.00 | 50.00 |" in rows["half"] and rows["most"].endswith("| 6.00 | - |")
    assert "pairs of rows in the paper's order" in table and table in capsys.readouterr().out
    results = row_results(summaries)  # what a results file keeps: the table prints again from it alone
    assert recipe_table(check_recipe(recipe(), "r"), json.loads(json.dumps(results)), "the embedded stories260K") == table
    assert main(["compare", "--recipe", str(path), "--methods", "cmoe", "--out", str(tmp_path / "x")]) == 2
    assert "--recipe names its rows' methods and options: leave out --methods and --apr" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
