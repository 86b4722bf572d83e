"""Reading a GPUPOOL_TRACE file (CSV: time_ns,thread,device,stream,action,ptr,size)."""

import csv
from collections import namedtuple

Row = namedtuple("Row", "time_ns thread device stream action ptr size")


def read(path):
    """Every row of the trace, in file order (which is time order per thread)."""
    with open(path, newline="") as f:
        r = csv.reader(f)
        header = next(r, None)
        if header != list(Row._fields):
            raise ValueError(f"{path}: not a gpupool trace (header {header!r}, expected {','.join(Row._fields)})")
        rows = []
        for n, rec in enumerate(r, start=2):
            try:
                rows.append(Row(int(rec[0]), int(rec[1]), int(rec[2]), int(rec[3], 16), rec[4], int(rec[5], 16), int(rec[6])))
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{n}: malformed row {rec!r}: {e}") from None
    rows.sort(key=lambda row: row.time_ns)
    return rows
