"""The fleet bench's table: per cell the three routers' p95s and the ratios the issue
bounds (learned / true, learned / shipped)."""

from loadgen.bench.sim.fleets import Cell, table


def test_a_cell_row_has_the_p95s_and_the_ratios() -> None:
    cells = [
        Cell("fast-far", "trace 0", 4.0, "shipped", 5000.0, 10000.0, 0.5),
        Cell("fast-far", "trace 0", 4.0, "learned", 3150.0, 9000.0, 0.08),
        Cell("fast-far", "trace 0", 4.0, "true", 3000.0, 9000.0, 0.4),
        Cell("slow-near", "trace 0", 4.0, "shipped", 1.0, 1.0, None),  # incomplete: no row
    ]
    lines = table(cells).splitlines()
    assert len(lines) == 3
    assert lines[2] == (
        "| fast-far | trace 0 | 4 | 5,000 / 3,150 / 3,000 | 10,000 / 9,000 / 9,000 | "
        "1.05, 1.00 | 0.63, 0.90 | 8.0% |"
    )
