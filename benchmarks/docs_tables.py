"""Every table of measured figures in README.md and docs/, written from the results files in
``benchmarks/results/``: each table is a benchmark's ``--markdown`` output, pasted between the markers
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` of its page.

    python benchmarks/docs_tables.py            # rewrite every table from the results files
    python benchmarks/docs_tables.py --check    # only say which tables differ (exit status 1 if any)

A new table: one ``Table`` line below and the two markers in its page (``tests/unit/test_cli.py`` fails while
a table differs from its results file).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Table:
    """The markers' ``name``, the ``page`` that holds them and the command that prints the table: a benchmark
    script's and its arguments, or ``moeify`` and a CLI command's (a table computed from configs alone)."""

    name: str
    page: str
    command: tuple[str, ...]

    def printed(self) -> str:
        """The table as the benchmark prints it from its results file."""
        program = ["-m", "moeify"] if self.command[0] == "moeify" else [str(HERE / self.command[0])]
        done = subprocess.run([sys.executable, *program, *self.command[1:]], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        return done.stdout

    def shown(self) -> str:
        return " ".join(self.command) if self.command[0] == "moeify" else f"python benchmarks/{' '.join(self.command)}"

    def markers(self) -> tuple[str, str]:
        return f"<!-- {self.name}:start -->\n", f"<!-- {self.name}:end -->"

    def block(self) -> str:
        """What the page holds between the markers now."""
        start, end = self.markers()
        text = (ROOT / self.page).read_text()
        if start not in text or end not in text:
            raise SystemExit(f"{self.page} has no {start.strip()} ... {end} markers for the table {self.name}")
        return text.split(start, 1)[1].split(end, 1)[0]

    def write(self, table: str) -> None:
        start, end = self.markers()
        path = ROOT / self.page
        before, rest = path.read_text().split(start, 1)
        path.write_text(before + start + table + end + rest.split(end, 1)[1])


def _speed(results: str) -> tuple[str, ...]:
    return ("serve_vllm.py", "--speed", "--markdown", "--out", f"{RESULTS}/{results}")


TABLES = (
    Table("bench_real_summary", "README.md", ("bench_real.py", "--markdown", "--summary")),
    Table("bench_real", "docs/results.md", ("bench_real.py", "--markdown")),
    Table("bench_real_recheck", "docs/results.md", ("bench_real.py", "--markdown", "--out",
                                                    f"{RESULTS}/bench_real_recheck.jsonl", "--against",
                                                    f"{RESULTS}/bench_real.jsonl")),
    Table("compare_recovery", "docs/results.md", ("compare_recovery.py", "--markdown")),
    Table("compare_recovery_losses", "docs/results.md", ("compare_recovery.py", "--run", "kd", "--markdown")),
    Table("compare_recovery_transfer", "docs/results.md", ("compare_recovery.py", "--transfer", "--markdown")),
    Table("bench_recovery", "docs/results.md", ("bench_recovery.py", "--markdown")),
    Table("bench_attention_sparsity", "docs/results.md", ("bench_attention_sparsity.py", "--markdown")),
    Table("bench_attention_split", "docs/results.md", ("bench_attention_split.py", "--markdown")),
    Table("bench_speed", "docs/results.md", ("bench_speed.py", "--markdown")),
    Table("bench_tomoe_speed", "docs/results.md", ("bench_tomoe_speed.py", "--markdown")),
    Table("bench_export_layout", "docs/results.md", ("bench_export_layout.py", "--markdown")),
    Table("bench_convert_layer", "docs/results.md", ("bench_convert_layer.py", "--markdown")),
    Table("bench_bf16_before", "docs/scaling.md", ("bench_bf16.py", "--markdown", "before")),
    Table("bench_bf16_current", "docs/scaling.md", ("bench_bf16.py", "--markdown", "current")),
    Table("bench_bf16_dsmoe_margin", "docs/scaling.md", ("bench_bf16.py", "--markdown", "dsmoe_margin")),
    Table("bench_precision_floor", "docs/scaling.md", ("bench_precision_floor.py", "--markdown")),
    Table("bench_memory_layer_by_layer", "docs/scaling.md", ("bench_memory.py", "--markdown", "--layer-by-layer")),
    Table("bench_fsdp", "docs/scaling.md", ("bench_fsdp.py", "--markdown")),
    Table("bench_memory", "docs/scaling.md", ("bench_memory.py", "--markdown")),
    Table("gpu_check", "docs/scaling.md", ("gpu_speed.py", "markdown")),
    Table("plan_table", "docs/scaling.md", ("moeify", "plan", "--table")),
    Table("plan_table_layer_by_layer", "docs/scaling.md", ("moeify", "plan", "--table", "--layer-by-layer")),
    Table("bench_dsmoe_start", "docs/methods/dsmoe.md", ("bench_dsmoe_start.py", "--markdown")),
    Table("bench_more_sweep", "docs/methods/more.md", ("bench_more_sweep.py", "--markdown")),
    Table("bench_spectral", "docs/methods/more.md", ("bench_spectral.py", "--markdown")),
    Table("bench_spectral_bound", "docs/methods/more.md", ("bench_spectral.py", "--bound", "--markdown")),
    *(Table(f"bench_recipes_{name}", f"docs/methods/{name.split('_')[0]}.md", ("bench_recipes.py", "--markdown", name))
      for name in ("cmoe_table1", "dense2moe_table5", "dsmoe_table3", "more_table10", "tomoe_table1")),
    Table("serve_vllm", "docs/serving.md", ("serve_vllm.py", "--markdown")),
    Table("serve_vllm_speed", "docs/serving.md", ("serve_vllm.py", "--speed", "--markdown")),
    Table("serve_vllm_speed_dsmoe", "docs/serving.md", _speed("serve_vllm_speed_dsmoe.jsonl")),
    Table("serve_vllm_speed_xeon_all", "docs/serving.md", _speed("serve_vllm_speed_xeon_all.jsonl")),
    Table("profile_vllm", "docs/serving.md", ("profile_vllm.py", "--markdown")),
    Table("serve_vllm_speed_zentorch", "docs/serving.md", _speed("serve_vllm_speed_zentorch.jsonl")),
    Table("serve_llamacpp", "docs/serving.md", ("serve_llamacpp.py", "--markdown")),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which tables differ from their results")
    args = parser.parse_args()
    stale = []
    for table in TABLES:
        printed = table.printed()
        if table.block() != printed:
            stale.append(table)
            if not args.check:
                table.write(printed)
    verb = "differs from its results file" if args.check else "rewritten from its results file"
    for table in stale:
        print(f"{table.page}: {table.name} {verb} ({table.shown()})")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
