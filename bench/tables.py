"""The fixed-width tables benchmarks print: one header line, one line a row, each column right-aligned."""


def text_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """`columns`: (header, key of the row, format spec such as ',' or '.2f'; a trailing 'x' is printed
    after the number). The first column is left-aligned, the others right-aligned."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f.removesuffix("x")) + ("x" if f.endswith("x") else "") for _, k, f in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in cells)
